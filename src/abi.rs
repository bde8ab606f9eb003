//! The contract with the Python package: op kind codes, the schedule
//! encoding, dtype codes, and the shapes of one call. This file and
//! `python/commfuse/_abi.py` are the only places that define them; the
//! library exports its tables (`tables`, through
//! `exports::python::commfuse_abi_tables`) and `jax_tests/test_abi.py`
//! compares them with Python's.
//!
//! The same codes reach the library twice: at trace time in a `prepare`
//! request (`crate::prepare`), and in the attributes of each XLA call
//! (`crate::call::Call::decode`).
#![forbid(unsafe_code)]

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{self, Schedule};
use crate::problem::{self, OpKind, Operand, Problem};
use serde::Deserialize;
use serde_json::{json, Value};

/// The op kinds; a kind's code is its index (`_abi.Kind`).
pub const KINDS: [OpKind; 14] = [
    OpKind::AllGatherMatmul,
    OpKind::AllGatherMatmulContract,
    OpKind::MatmulAllGather,
    OpKind::MatmulAllGatherContract,
    OpKind::MatmulReduceScatter,
    OpKind::MatmulReduceScatterCols,
    OpKind::AllToAllMatmul,
    OpKind::AllToAllMatmulContract,
    OpKind::MatmulAllToAll,
    OpKind::MatmulAllToAllCols,
    OpKind::MatmulAllReduce,
    OpKind::AllGatherMatmulReduceScatter,
    OpKind::AllGatherBothMatmul,
    OpKind::AllGatherContractMatmulReduceScatter,
];

/// The attributes of a fused op's call, as Python's lowering writes them
/// (`_fused._lower_target`) and `call::SiteKey` and the CUDA handler read
/// them: `tf32` (CUDA), `local_ordinals`, `nccl_groups` and `nccl_ids`
/// (CUDA, meshes spanning processes) are optional.
pub const ATTRIBUTES: [&str; 11] = [
    "kind",
    "site",
    "schedule",
    "dimension",
    "mesh_devices",
    "mesh_shape",
    "axes",
    "tf32",
    "local_ordinals",
    "nccl_groups",
    "nccl_ids",
];

/// The op kind of a `kind` code.
pub fn kind(code: i64) -> Result<OpKind> {
    usize::try_from(code)
        .ok()
        .and_then(|i| KINDS.get(i).copied())
        .ok_or_else(|| Error::InvalidArgument(format!("unknown op kind {code}")))
}

pub fn kind_code(kind: OpKind) -> i64 {
    KINDS.iter().position(|&k| k == kind).expect("every kind is in KINDS") as i64
}

/// Schedule codes: the low byte of a `schedule` code (`_abi.SCHEDULES`).
/// "sliced" and "tiled" carry their number of chunks above it
/// (`SLICED | slices << CHUNKS_SHIFT`); "unfused" (jax.lax's own collective
/// and dot) never reaches a handler.
pub const SCHEDULES: [(&str, i64); 7] = [
    ("auto", AUTO),
    ("ring", 1),
    ("bidirectional", 2),
    ("sequential", 3),
    ("sliced", SLICED),
    ("tiled", TILED),
    ("unfused", UNFUSED),
];
pub const AUTO: i64 = 0;
pub const SLICED: i64 = 4;
pub const TILED: i64 = 5;
pub const UNFUSED: i64 = 6;
pub const CHUNKS_SHIFT: u32 = 8;

/// The schedule a `schedule` code asks `kind` to run.
pub fn schedule(kind: OpKind, code: i64) -> Result<Schedule> {
    let name = kind.name();
    if code < 0 {
        return Err(Error::InvalidArgument(format!(
            "{name}: schedule code {code} is negative: not a schedule (a sliced or tiled code carries its count above \
             the low byte, at most {})",
            plan::MAX_CHUNKS
        )));
    }
    match code & 0xff {
        SLICED | TILED => {
            let (what, unit) = if code & 0xff == SLICED { ("sliced", "slices") } else { ("tiled", "tiles") };
            let chunks = code >> CHUNKS_SHIFT;
            if chunks < 1 || chunks > plan::MAX_CHUNKS as i64 {
                return Err(Error::InvalidArgument(format!(
                    "{name}: the {what} schedule needs {unit} in [1, {}], got {chunks}",
                    plan::MAX_CHUNKS
                )));
            }
            if kind == OpKind::AllGatherContractMatmulReduceScatter {
                return Err(Error::InvalidArgument(format!(
                    "{name}: no \"{what}\" schedule: both rings run one way (\"ring\"), or nothing overlaps \
                     (\"sequential\")"
                )));
            }
            // The two-axis kinds cut one operand's blocks: w's columns (gather-scatter), x's rows (two gathers).
            let two_axis = matches!(kind, OpKind::AllGatherMatmulReduceScatter | OpKind::AllGatherBothMatmul);
            if two_axis && what == "tiled" {
                let cut =
                    if kind == OpKind::AllGatherBothMatmul { "x's row blocks" } else { "each block of w's columns" };
                return Err(Error::InvalidArgument(format!(
                    "{name}: no \"tiled\" schedule: \"sliced\" cuts {cut} into chunks"
                )));
            }
            if !two_axis && (!Schedule::sliceable(kind.pattern()) || !kind.cuts_rows()) {
                return Err(Error::InvalidArgument(format!(
                    "{name}: schedule \"{what}\" exists only for all_gather_matmul and matmul_reduce_scatter along a \
                     row dim, matmul_all_reduce, and (sliced) all_gather_matmul_reduce_scatter and \
                     all_gather_both_matmul"
                )));
            }
            let chunks = chunks as usize;
            Ok(if code & 0xff == SLICED {
                Schedule::Sliced { slices: chunks }
            } else {
                Schedule::Tiled { tiles: chunks }
            })
        }
        2 if kind.pattern().two_axis().is_some() && code == 2 => Err(Error::InvalidArgument(format!(
            "{name}: schedule \"bidirectional\" does not exist here: both rings run one way (\"ring\"), or nothing \
             overlaps (\"sequential\")"
        ))),
        _ => match code {
            AUTO => Ok(Schedule::Auto),
            1 => Ok(Schedule::Ring),
            2 => Ok(Schedule::Bidirectional),
            3 => Ok(Schedule::Sequential),
            UNFUSED => Err(Error::InvalidArgument(format!(
                "{name}: schedule \"unfused\" is jax.lax's own collective and dot; it never reaches the library"
            ))),
            _ => Err(Error::InvalidArgument(format!("{name}: unknown schedule code {code}"))),
        },
    }
}

/// The code of `schedule` (the inverse of `schedule`).
pub fn schedule_code(schedule: Schedule) -> i64 {
    match schedule {
        Schedule::Auto => AUTO,
        Schedule::Ring => 1,
        Schedule::Bidirectional => 2,
        Schedule::Sequential => 3,
        Schedule::Sliced { slices } => SLICED | (slices as i64) << CHUNKS_SHIFT,
        Schedule::Tiled { tiles } => TILED | (tiles as i64) << CHUNKS_SHIFT,
    }
}

/// XLA's PrimitiveType numbers of the dtypes the ops take (`_abi.DTYPES`).
pub const DTYPES: [(DType, u32); 6] = [
    (DType::F32, 11),
    (DType::F64, 12),
    (DType::BF16, 16),
    (DType::F16, 10),
    (DType::F8E4M3FN, 20),
    (DType::F8E5M2, 19),
];

/// The dtype of an XLA code; `None` for types the ops do not take.
pub fn dtype(code: u32) -> Option<DType> {
    DTYPES.iter().find(|&&(_, c)| c == code).map(|&(d, _)| d)
}

pub fn dtype_code(dtype: DType) -> u32 {
    DTYPES.iter().find(|&&(d, _)| d == dtype).map(|&(_, c)| c).expect("every dtype is in DTYPES")
}

/// One call as Python describes it at trace time (`_abi.Call`): the
/// operands in the kind's layout; the result's shape follows from them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallShapes {
    pub kind: i64,
    pub schedule: i64,
    pub ranks: i64,
    pub dimension: i64,
    pub x: Vec<i64>,
    pub w: Vec<i64>,
    pub input: u32,
    pub output: u32,
}

impl CallShapes {
    /// The op, group size, result dims and problem these shapes describe
    /// (before a sliced or tiled schedule cuts it).
    pub fn problem(&self) -> Result<(OpKind, usize, Vec<usize>, Problem)> {
        let kind = kind(self.kind)?;
        let ranks = usize::try_from(self.ranks).ok().filter(|&r| (1..=plan::MAX_RANKS).contains(&r));
        let ranks = ranks.ok_or_else(|| {
            Error::InvalidArgument(format!("ranks must be in [1, {}], got {}", plan::MAX_RANKS, self.ranks))
        })?;
        let dtype =
            |code: u32| dtype(code).ok_or_else(|| Error::InvalidArgument(format!("unsupported dtype code {code}")));
        let (input, output) = (dtype(self.input)?, dtype(self.output)?);
        let out = problem::result_dims(kind, &self.x, &self.w, self.dimension, ranks)?;
        // Within MAX_ELEMENTS, each dim fits an i64.
        let out_dims: Vec<i64> = out.iter().map(|&d| d as i64).collect();
        let problem = Problem::new(
            kind,
            Operand { dims: &self.x, dtype: input },
            Operand { dims: &self.w, dtype: input },
            Operand { dims: &out_dims, dtype: output },
            self.dimension,
            ranks,
        )?;
        Ok((kind, ranks, out, problem))
    }
}

/// `AllGatherMatmul` -> `ALL_GATHER_MATMUL`: the name Python's enum gives it.
fn screaming_snake(camel: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Every table above and the library's limits, as JSON (for the test that
/// compares them with Python's).
pub fn tables() -> Value {
    let kinds: serde_json::Map<String, Value> =
        KINDS.iter().map(|&k| (screaming_snake(&format!("{k:?}")), json!(kind_code(k)))).collect();
    let schedules: serde_json::Map<String, Value> = SCHEDULES.iter().map(|&(n, c)| (n.to_string(), json!(c))).collect();
    let dtypes: serde_json::Map<String, Value> =
        DTYPES.iter().map(|&(d, c)| (d.name().to_string(), json!(c))).collect();
    // What each kind takes, for Python's checks (one definition, here).
    let kind_info: serde_json::Map<String, Value> = KINDS
        .iter()
        .map(|&k| {
            let info = json!({
                "operands": k.operand_names(),
                "op": k.name(),
                "row_blocks": k.row_blocks(),
                "cuts_rows": k.cuts_rows()
            });
            (screaming_snake(&format!("{k:?}")), info)
        })
        .collect();
    json!({
        "kinds": kinds,
        "kind_info": kind_info,
        "attributes": ATTRIBUTES,
        "schedules": schedules,
        "chunks_shift": CHUNKS_SHIFT,
        "dtypes": dtypes,
        "limits": {
            "max_ranks": plan::MAX_RANKS,
            "max_chunks": plan::MAX_CHUNKS,
            "max_cut_blocks": plan::MAX_CUT_BLOCKS,
            "max_elements": problem::MAX_ELEMENTS,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for (i, &k) in KINDS.iter().enumerate() {
            assert_eq!(kind(i as i64), Ok(k));
            assert_eq!(kind_code(k), i as i64);
        }
        assert!(kind(KINDS.len() as i64).is_err() && kind(-1).is_err());
        for &(d, c) in &DTYPES {
            assert_eq!((dtype(c), dtype_code(d)), (Some(d), c));
        }
        for bad in [0, 1, 13, 99, u32::MAX] {
            assert_eq!(dtype(bad), None, "code {bad}");
        }
        let k = OpKind::AllGatherMatmul;
        for s in [
            Schedule::Auto,
            Schedule::Ring,
            Schedule::Bidirectional,
            Schedule::Sequential,
            Schedule::Sliced { slices: 3 },
            Schedule::Tiled { tiles: 1024 },
        ] {
            assert_eq!(schedule(k, schedule_code(s)), Ok(s));
        }
        assert_eq!(screaming_snake("MatmulAllToAllCols"), "MATMUL_ALL_TO_ALL_COLS");
    }

    #[test]
    fn schedule_codes_at_the_edges_say_what_is_wrong() {
        let kind = OpKind::AllGatherMatmul;
        let message = |code: i64| schedule(kind, code).unwrap_err().to_string();
        // tiles = 2^55 wraps the code negative: once "unknown schedule code -9223372036854775803".
        let wrapped = TILED | (1i64 << 55).wrapping_shl(CHUNKS_SHIFT);
        assert!(message(wrapped).contains("is negative: not a schedule"), "{}", message(wrapped));
        // tiles = 2^56 shifts out to 0 tiles: once "needs tiles >= 1".
        assert!(message(TILED).contains("needs tiles in [1, 1024], got 0"), "{}", message(TILED));
        assert!(message(TILED | (1025 << 8)).contains("got 1025"));
        assert!(message(TILED | (1 << 40 << 8)).contains("got 1099511627776"));
        assert!(message(99).contains("unknown schedule code 99"));
        assert!(message(UNFUSED).contains("never reaches the library"));
        let e = schedule(OpKind::MatmulAllGather, TILED | (2 << 8)).unwrap_err();
        assert!(e.to_string().contains("exists only for all_gather_matmul and matmul_reduce_scatter"), "{e}");
    }

    #[test]
    fn a_call_gives_its_result_dims() {
        let call = CallShapes {
            kind: 0,
            schedule: 0,
            ranks: 4,
            dimension: 1,
            x: vec![2, 3, 8],
            w: vec![8, 5],
            input: 11,
            output: 16,
        };
        let (kind, ranks, out, problem) = call.problem().unwrap();
        assert_eq!((kind, ranks, out), (OpKind::AllGatherMatmul, 4, vec![2, 12, 5]));
        assert_eq!((problem.input, problem.output), (DType::F32, DType::BF16));
        let bad = CallShapes { ranks: 1 << 40, ..call.clone() };
        assert!(bad.problem().unwrap_err().to_string().contains("ranks must be in [1, 65536]"));
    }
}
