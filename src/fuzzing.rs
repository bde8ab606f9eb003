//! The fuzzers' cases, made from arbitrary bytes: call frames for the
//! exported CPU handler, and problems and plans for the planner. libFuzzer
//! feeds them bytes in `fuzz/`, a seeded generator in `tests/frame_fuzz.rs`,
//! and `tests/fuzz_corpus.rs` replays the corpus checked in under
//! `fuzz/corpus/`. Each `check_*` returns `Err` saying what broke: a panic,
//! an error code a case of its kind must not get, a wrong result.
//!
//! A frame case starts as a valid call of a random op (shapes, dtypes,
//! schedule, mesh, workspace as Python would lower it), then may get value
//! mutations (dims, including 0, negative and overflowing ones; dtype codes;
//! attribute values and types; operand counts) and structural corruptions
//! (`synthetic::Corruption`). What it must get:
//! - never a panic (a caught one is an INTERNAL "panic in ..."), never an
//!   abort, only the library's error codes;
//! - a well-formed frame (no corruption, every buffer allocated): no INTERNAL;
//! - a valid call on one rank: success, and the product `jax.lax` gives;
//! - a valid call on several ranks (whose peers never come): DEADLINE_EXCEEDED
//!   after the short test timeout, or success at once when it has nothing to
//!   compute (an empty result or contraction).
#![forbid(unsafe_code)]

use crate::abi::{self, CallShapes};
use crate::backend::cpu::numeric::{load, store};
use crate::backend::cpu::CpuLayout;
use crate::call;
use crate::dtype::DType;
use crate::group::Group;
use crate::plan::{Action, Buf, SlotKind};
use crate::prepare;
use crate::problem::{Side, View};
use crate::xla::synthetic::{self, Attr, Built, Call, Corruption, Handler};
use crate::xla::sys;
use arbitrary::{Result, Unstructured};

const F32: u32 = sys::XLA_FFI_DataType_F32;
const F64: u32 = sys::XLA_FFI_DataType_F64;
const BF16: u32 = sys::XLA_FFI_DataType_BF16;
const F16: u32 = sys::XLA_FFI_DataType_F16;
const U8: u32 = sys::XLA_FFI_DataType_U8;
const DTYPES: [u32; 4] = [F32, F64, BF16, F16];

/// Dims, counts and codes at the edges: empty, one, negative, and products
/// that overflow i64, usize or the library's limits.
const INTERESTING: [i64; 16] = [
    0,
    1,
    2,
    3,
    7,
    -1,
    -2,
    i64::MIN,
    i64::MAX,
    1 << 31,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    1 << 55,
    1 << 62,
    (1 << 62) + 1,
];

/// The canonical product of a valid call on one rank: `out = lhs @ rhs`,
/// `lhs` (operand `lhs`) as `rows x k`, the other operand `k x n`.
#[derive(Debug, Clone, Copy)]
struct Product {
    lhs: usize,
    rows: usize,
    k: usize,
    n: usize,
}

/// One generated call of the CPU handler and what it must get.
pub struct FrameCase {
    pub call: Call,
    pub corruptions: Vec<Corruption>,
    /// Values were changed from the valid call (any outcome but a panic or
    /// an unknown code is then fine, and INTERNAL only if not well formed).
    pub mutated: bool,
    pub ranks: usize,
    /// Nothing to compute: an empty result or contraction.
    pub trivial: bool,
    product: Product,
    /// Seeds the operands' values.
    seed: u64,
}

/// What a checked case got, for the fuzzers' statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// An error with this XLA code.
    Error(u32),
}

fn dim(u: &mut Unstructured) -> Result<i64> {
    // Small, and 0 one time in six: every op meets empty operands.
    Ok(i64::from(u.int_in_range(0u8..=5)?))
}

/// A valid call of a random op on a random group (as Python lowers it).
fn valid_call(u: &mut Unstructured) -> Result<FrameCase> {
    let kind = u.int_in_range(0u8..=13)?;
    let r = *u.choose(&[1usize, 1, 1, 1, 2, 3, 4])?;
    let ri = r as i64;
    // The two-axis ops' group is F x T (its first axis's size F first).
    let f = *u.choose(&(1..=r).filter(|f| r % f == 0).collect::<Vec<_>>())? as i64;
    let t = ri / f;
    let (m, k, n) = (dim(u)?, dim(u)?, dim(u)?);
    let input = *u.choose(&DTYPES)?;
    let output = *u.choose(&DTYPES)?;
    // (x dims, w dims, out dims, dimension attr, lhs operand)
    let (x, w, out, dimension, lhs): (Vec<i64>, Vec<i64>, Vec<i64>, i64, usize) = match kind {
        0 | 4 => {
            let rank3 = u.arbitrary::<bool>()?;
            let a = dim(u)?;
            let d = if rank3 { i64::from(u.int_in_range(0u8..=1)?) } else { 0 };
            let mut x = if rank3 { vec![a, m, k] } else { vec![m, k] };
            let mut out = x.clone();
            *out.last_mut().expect("rank >= 2") = n;
            if kind == 0 {
                out[d as usize] *= ri;
            } else {
                x[d as usize] *= ri;
            }
            (x, vec![k, n], out, d, 0)
        }
        1 => (vec![m, k], vec![ri * k, n], vec![m, n], 0, 0),
        2 => (vec![k, n], vec![m, k], vec![m, ri * n], 0, 1),
        3 => (vec![k, n], vec![m, ri * k], vec![m, n], 0, 1),
        5 => (vec![m, k], vec![k, ri * n], vec![m, n], 0, 0),
        6 | 8 => (vec![ri, m, k], vec![k, n], vec![ri, m, n], 0, 0),
        7 => (vec![ri, m, k], vec![ri * k, n], vec![m, n], 0, 0),
        9 => (vec![m, k], vec![k, ri * n], vec![ri, m, n], 0, 0),
        10 => (vec![ri * m, k], vec![k, n], vec![ri * m, n], 0, 0),
        11 => (vec![k, n], vec![t * m, k], vec![f, m, n], f, 1),
        12 => (vec![m, f * k], vec![k, n], vec![t * m, n], f, 0),
        _ => (vec![f * m, k], vec![t * k, n], vec![m, n], f, 0),
    };
    let rows = usize::try_from(x_rows(&x, &w, lhs)).unwrap_or(0);
    let trivial = out.contains(&0) || k == 0;

    // Schedules: the four plain ones, or a cut one where it exists (a row
    // gather or scatter along the leading dim), its chunks dividing a block's rows.
    let mut schedule = i64::from(u.int_in_range(0u8..=3)?);
    if kind >= 11 && schedule == 2 {
        schedule = 1; // the two-axis ops have no bidirectional plan
    }
    if matches!(kind, 0 | 4) && dimension == 0 && u.arbitrary::<bool>()? {
        let block_rows = if kind == 0 { rows } else { rows / r };
        let divisors: Vec<usize> = (1..=block_rows.max(1)).filter(|c| block_rows % c == 0).collect();
        let chunks = *u.choose(&divisors)? as i64;
        let code = if u.arbitrary::<bool>()? { abi::SLICED } else { abi::TILED };
        schedule = code | (chunks << 8);
    }

    // The mesh: this device (the fake API's ordinal) at a random rank of a
    // 1-D group, sometimes inside a 2-D mesh whose other axis is left out.
    let me = i64::from(synthetic::DEVICE_ORDINAL);
    let at = u.int_in_range(0..=r - 1)?;
    let group: Vec<i64> = (0..r).map(|q| if q == at { me } else { 3000 + q as i64 }).collect();
    let (mesh_devices, mesh_shape, axes) = if kind >= 11 {
        (group, vec![f, t], vec![0, 1])
    } else if u.arbitrary::<bool>()? {
        let mut devices = group.clone();
        devices.extend(group.iter().map(|d| d + 100_000));
        (devices, vec![2, ri], vec![1])
    } else {
        (group, vec![ri], vec![0])
    };

    let shapes =
        CallShapes { kind: i64::from(kind), schedule, ranks: ri, dimension, x: x.clone(), w: w.clone(), input, output };
    let request = prepare::Request { call: shapes, machine: None, gemm_gflops: None, explain: false, trace: None };
    // As Python lowers it: the CPU's workspace from the trace-time answer.
    let workspace = prepare::prepare(&request).map_or(0, |p| p.workspace.cpu) as i64;
    let call = Call {
        args: vec![(input, x), (input, w)],
        rets: vec![(output, out), (U8, vec![workspace])],
        attrs: vec![
            ("kind", Attr::I64(i64::from(kind))),
            ("schedule", Attr::I64(schedule)),
            ("site", Attr::I64(u.int_in_range(1..=1 << 20)?)),
            ("dimension", Attr::I64(dimension)),
            ("mesh_devices", Attr::I64s(mesh_devices)),
            ("mesh_shape", Attr::I64s(mesh_shape)),
            ("axes", Attr::I64s(axes)),
        ],
        ..Default::default()
    };
    let product = Product { lhs, rows, k: k as usize, n: n as usize };
    Ok(FrameCase { call, corruptions: vec![], mutated: false, ranks: r, trivial, product, seed: u.arbitrary()? })
}

/// Rows of the `lhs` operand as a matrix (all dims but the last).
fn x_rows(x: &[i64], w: &[i64], lhs: usize) -> i64 {
    let a = if lhs == 0 { x } else { w };
    a[..a.len() - 1].iter().product()
}

fn interesting(u: &mut Unstructured) -> Result<i64> {
    Ok(if u.ratio(3u8, 4)? { *u.choose(&INTERESTING)? } else { u.arbitrary()? })
}

fn any_attr(u: &mut Unstructured) -> Result<Attr> {
    Ok(match u.int_in_range(0u8..=4)? {
        0 => Attr::I64(interesting(u)?),
        1 => Attr::I32(u.arbitrary()?),
        2 => Attr::F32(u.arbitrary()?),
        3 => {
            let len = u.int_in_range(0usize..=4)?;
            Attr::I64s((0..len).map(|_| interesting(u)).collect::<Result<_>>()?)
        }
        _ => Attr::Str("not a number"),
    })
}

/// One change of a value a caller controls.
fn mutate(u: &mut Unstructured, call: &mut Call) -> Result<()> {
    const NAMES: [&str; 8] = ["kind", "schedule", "site", "dimension", "mesh_devices", "mesh_shape", "axes", "zzz"];
    match u.int_in_range(0u8..=9)? {
        // A dim of an operand or result.
        0 | 1 => {
            let on_args = u.arbitrary::<bool>()?;
            let list = if on_args { &mut call.args } else { &mut call.rets };
            if let Some(i) = (!list.is_empty()).then(|| u.int_in_range(0..=list.len() - 1)).transpose()? {
                let dims = &mut list[i].1;
                if !dims.is_empty() {
                    let j = u.int_in_range(0..=dims.len() - 1)?;
                    dims[j] = interesting(u)?;
                }
            }
        }
        // A dim more or less.
        2 => {
            let list = if u.arbitrary::<bool>()? { &mut call.args } else { &mut call.rets };
            if let Some(i) = (!list.is_empty()).then(|| u.int_in_range(0..=list.len() - 1)).transpose()? {
                if u.arbitrary::<bool>()? {
                    list[i].1.pop();
                } else {
                    let d = dim(u)?;
                    list[i].1.insert(0, d);
                }
            }
        }
        // A dtype code.
        3 => {
            let list = if u.arbitrary::<bool>()? { &mut call.args } else { &mut call.rets };
            if let Some(i) = (!list.is_empty()).then(|| u.int_in_range(0..=list.len() - 1)).transpose()? {
                list[i].0 =
                    *u.choose(&[F32, F64, BF16, F16, 19, 20, U8, sys::XLA_FFI_DataType_S32, 0, 99, u32::MAX])?;
            }
        }
        // An operand or result more or less.
        4 => {
            let list = if u.arbitrary::<bool>()? { &mut call.args } else { &mut call.rets };
            if u.arbitrary::<bool>()? {
                list.pop();
            } else {
                list.push((F32, vec![2, 2]));
            }
        }
        // An attribute's value (of any type), gone, or a stray one.
        5 | 6 => {
            let name = *u.choose(&NAMES)?;
            let attr = any_attr(u)?;
            call.attrs.retain(|(n, _)| *n != name);
            call.attrs.push((name, attr));
        }
        7 => {
            let name = *u.choose(&NAMES)?;
            call.attrs.retain(|(n, _)| *n != name);
        }
        // Schedule codes at the edges of the cut encoding.
        8 => {
            let chunks = interesting(u)?;
            let code = *u.choose(&[abi::SLICED, abi::TILED, 0, 6, 255])?;
            call.attrs.retain(|(n, _)| *n != "schedule");
            call.attrs.push(("schedule", Attr::I64(code | chunks.wrapping_shl(8))));
        }
        // The workspace's size.
        _ => {
            if let Some(ws) = call.rets.get_mut(1) {
                ws.1 = vec![interesting(u)?.rem_euclid(1 << 16)];
            }
        }
    }
    Ok(())
}

fn corruption(u: &mut Unstructured) -> Result<Corruption> {
    let size = *u.choose(&[0usize, 1, 8, 16, 24, 1 << 20, usize::MAX])?;
    let index = u.int_in_range(0usize..=7)?;
    let result = u.arbitrary()?;
    Ok(match u.int_in_range(0u8..=16)? {
        0 => Corruption::FrameStructSize(size),
        1 => Corruption::ApiStructSize(size),
        2 => Corruption::ArgsStructSize(size),
        3 => Corruption::RetsStructSize(size),
        4 => Corruption::AttrsStructSize(size),
        5 => Corruption::BufferStructSize { result, index, size },
        6 => Corruption::NegativeCount { list: index },
        7 => Corruption::NullArray { list: index, which: u.arbitrary()? },
        8 => Corruption::ArgType { index, code: u.arbitrary()? },
        9 => Corruption::RetType { index, code: u.arbitrary()? },
        10 => Corruption::NegativeRank { result, index },
        11 => Corruption::NullDims { result, index },
        12 => Corruption::AttrType { index, code: u.arbitrary()? },
        13 => Corruption::NullAttrValue { index },
        14 => Corruption::NullAttrName { index },
        15 => Corruption::NullApi,
        _ => Corruption::Stage(u.arbitrary()?),
    })
}

/// A frame case from `u`: a valid call, then (sometimes) mutations and corruptions.
pub fn frame_case(u: &mut Unstructured) -> Result<FrameCase> {
    let mut case = valid_call(u)?;
    if u.ratio(1u8, 2)? {
        for _ in 0..u.int_in_range(1u8..=3)? {
            mutate(u, &mut case.call)?;
        }
        case.mutated = true;
    }
    if u.ratio(1u8, 8)? {
        for _ in 0..u.int_in_range(1u8..=2)? {
            case.corruptions.push(corruption(u)?);
        }
    }
    Ok(case)
}

/// Values in [-1, 1], never all zero, from a seed (splitmix64).
fn values(seed: u64, len: usize) -> Vec<f64> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// Fills operand `i` of `dtype` with values (when it is allocated and of a
/// float dtype); returns them as the operand holds them (rounded to its dtype).
fn fill(built: &mut Built, dtype: Option<u32>, i: usize, seed: u64) -> Option<Vec<f64>> {
    let dtype = abi::dtype(dtype?).filter(|d| !d.is_fp8())?;
    let data = built.arg_data_mut(i)?;
    let values = values(seed ^ i as u64, data.len() / dtype.size());
    store(&values, dtype, data).ok()?;
    let mut held = vec![0f64; values.len()];
    load(data, dtype, &mut held).ok()?;
    Some(held)
}

const ALLOWED: [u32; 5] = [
    sys::XLA_FFI_Error_Code_INVALID_ARGUMENT,
    sys::XLA_FFI_Error_Code_UNIMPLEMENTED,
    sys::XLA_FFI_Error_Code_DEADLINE_EXCEEDED,
    sys::XLA_FFI_Error_Code_INTERNAL,
    sys::XLA_FFI_Error_Code_CANCELLED,
];

/// What every frame case must get from its call's `result` (see the
/// module's doc): no error left unreported by a frame that could report it,
/// only the library's codes, no panic, no INTERNAL for a well-formed frame.
/// Returns the call's error, if any, for the case's own checks.
fn every_frame_checks(
    result: Option<(u32, String)>,
    corrupted: bool,
    well_formed: bool,
    what: &dyn Fn() -> String,
) -> std::result::Result<Option<(u32, String)>, String> {
    // A frame that cannot carry an error back leaves it for the next call:
    // taken here, so the next case does not get it.
    let unreported = crate::xla::take_unreported();
    if let (Some(e), false) = (&unreported, corrupted) {
        return Err(format!("a frame that could carry its error left one unreported: {e} ({})", what()));
    }
    if let Some((code, message)) = &result {
        if !ALLOWED.contains(code) {
            return Err(format!("error code {code} is not one of the library's: {message} ({})", what()));
        }
        if message.contains("panic") {
            return Err(format!("a panic: {message} ({})", what()));
        }
        if well_formed && *code == sys::XLA_FFI_Error_Code_INTERNAL {
            return Err(format!("INTERNAL for a well-formed frame: {message} ({})", what()));
        }
    }
    Ok(result)
}

/// Runs `case` through `handler` and checks what it got (see the module's doc).
pub fn check_frame_case(case: FrameCase, handler: Handler) -> std::result::Result<Outcome, String> {
    let FrameCase { call, corruptions, mutated, ranks, trivial, product, seed } = case;
    let valid = !mutated && corruptions.is_empty();
    let out_dtype = call.rets.first().and_then(|r| abi::dtype(r.0));
    let input = call.args.first().and_then(|a| abi::dtype(a.0));
    let arg_dtype = |i: usize| call.args.get(i).map(|a| a.0);
    let what = || format!("{call:?}, corruptions {corruptions:?}, mutated {mutated}, ranks {ranks}");
    let mut frame = call.clone().build();
    let lhs = fill(&mut frame, arg_dtype(product.lhs), product.lhs, seed);
    let rhs = fill(&mut frame, arg_dtype(1 - product.lhs), 1 - product.lhs, seed);
    // Not `any`: every corruption is applied.
    let corrupted = corruptions.iter().filter(|&&c| frame.corrupt(c)).count() > 0;
    let well_formed = !corrupted && frame.allocated();

    let result = every_frame_checks(frame.call(handler), corrupted, well_formed, &what)?;
    let outcome = match result {
        None => Outcome::Success,
        Some((code, message)) => {
            if valid && (ranks == 1 || trivial) {
                return Err(format!("a valid call failed: {message} ({})", what()));
            }
            if valid && code != sys::XLA_FFI_Error_Code_DEADLINE_EXCEEDED {
                return Err(format!("a valid call without its peers did not time out: {message} ({})", what()));
            }
            Outcome::Error(code)
        }
    };
    if valid && outcome == Outcome::Success && ranks > 1 && !trivial {
        return Err(format!("a call without its peers succeeded ({})", what()));
    }
    if valid && ranks == 1 {
        let (Some(lhs), Some(rhs), Some(out_dtype)) = (lhs, rhs, out_dtype) else {
            return Err(format!("a valid call's buffers were not filled ({})", what()));
        };
        let Some(got) = frame.ret_data(0) else { return Err(format!("no result buffer ({})", what())) };
        let mut out = vec![0f64; got.len() / out_dtype.size()];
        load(got, out_dtype, &mut out).map_err(|e| e.to_string())?;
        let Product { rows, k, n, .. } = product;
        let eps = |d: DType| -> f64 {
            match d {
                DType::F64 => 1e-15,
                DType::F32 => 1e-7,
                DType::F16 => 1e-3,
                _ => 8e-3,
            }
        };
        let input = input.unwrap_or(DType::F32);
        let tolerance = 4.0 * (k as f64 + 1.0) * eps(input).max(eps(out_dtype));
        for row in 0..rows {
            for col in 0..n {
                let want: f64 = (0..k).map(|j| lhs[row * k + j] * rhs[j * n + col]).sum();
                let have = out[row * n + col];
                if (want - have).abs() > tolerance {
                    return Err(format!("out[{row}, {col}] = {have}, expected {want} ({})", what()));
                }
            }
        }
    }
    Ok(outcome)
}

/// A frame case for the CPU handlers of `commfuse.reshard`'s send or
/// receive program: a valid call of a small reshard whose other devices
/// never come (this device holding and needing a tile), then (sometimes)
/// mutations of its attributes and buffers and structural corruptions.
/// What it must get, besides what every frame must (no panic, only the
/// library's codes, no INTERNAL for a well-formed frame): a valid send
/// succeeds (it posts and goes on), a valid receive ends in
/// DEADLINE_EXCEEDED (its pieces never come).
#[derive(Debug)]
pub struct ReshardCase {
    pub call: Call,
    pub corruptions: Vec<Corruption>,
    pub mutated: bool,
    pub send: bool,
}

/// Call sites of the reshard cases, above any the other tests use.
static RESHARD_SITES: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(1 << 48);
/// The call id every reshard case passes.
const RESHARD_CALL_ID: u32 = 7;

/// A reshard frame case from `u` (see [`ReshardCase`]).
pub fn reshard_case(u: &mut Unstructured) -> Result<ReshardCase> {
    let send = u.arbitrary::<bool>()?;
    let ranks = u.int_in_range(1usize..=4)?;
    let at = u.int_in_range(0..=ranks - 1)?;
    let devices: Vec<i64> =
        (0..ranks).map(|q| if q == at { i64::from(synthetic::DEVICE_ORDINAL) } else { 4000 + q as i64 }).collect();
    let (rows, cols) = ((ranks * u.int_in_range(1usize..=4)?) as i64, i64::from(u.int_in_range(1u8..=4)?));
    let itemsize = *u.choose(&[1i64, 2, 4, 8])?;
    // Each side: the array on every rank, or its rows split over the ranks.
    let tiles = |u: &mut Unstructured| -> Result<(Vec<i64>, i64)> {
        let split = u.arbitrary::<bool>()?;
        let per = if split { rows / ranks as i64 } else { rows };
        let flat =
            (0..ranks as i64).flat_map(|q| if split { [q * per, 0, (q + 1) * per, cols] } else { [0, 0, rows, cols] });
        Ok((flat.collect(), per * cols * itemsize))
    };
    let ((src, src_bytes), (dst, dst_bytes)) = (tiles(u)?, tiles(u)?);
    let call_id = (sys::XLA_FFI_DataType_U32, vec![]);
    let (args, rets) = if send {
        (vec![(U8, vec![src_bytes]), call_id], vec![(U8, vec![1])])
    } else {
        (vec![call_id], vec![(U8, vec![dst_bytes])])
    };
    let attrs = vec![
        ("devices", Attr::I64s(devices)),
        ("shape", Attr::I64s(vec![rows, cols])),
        ("itemsize", Attr::I64(itemsize)),
        ("src", Attr::I64s(src)),
        ("dst", Attr::I64s(dst)),
        ("method", Attr::I64(i64::from(u.int_in_range(0u8..=2)?))),
        ("chunk_bytes", Attr::I64(i64::from(u.int_in_range(1u8..=64)?))),
        // A site of its own per case: no case meets another's transport session.
        ("site", Attr::I64(RESHARD_SITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed))),
    ];
    let mut case =
        ReshardCase { call: Call { args, rets, attrs, ..Call::default() }, corruptions: vec![], mutated: false, send };
    if u.ratio(1u8, 2)? {
        for _ in 0..u.int_in_range(1u8..=3)? {
            if u.arbitrary::<bool>()? {
                mutate(u, &mut case.call)?;
            } else {
                let i = u.int_in_range(0..=case.call.attrs.len() - 1)?;
                case.call.attrs[i].1 = match &case.call.attrs[i].1 {
                    Attr::I64s(values) if !values.is_empty() && u.arbitrary::<bool>()? => {
                        let mut values = values.clone();
                        let j = u.int_in_range(0..=values.len() - 1)?;
                        values[j] = interesting(u)?;
                        Attr::I64s(values)
                    }
                    Attr::I64s(_) => {
                        Attr::I64s((0..u.int_in_range(0u8..=9)?).map(|_| interesting(u)).collect::<Result<_>>()?)
                    }
                    _ => Attr::I64(interesting(u)?),
                };
            }
        }
        case.mutated = true;
    }
    if u.ratio(1u8, 8)? {
        for _ in 0..u.int_in_range(1u8..=2)? {
            case.corruptions.push(corruption(u)?);
        }
    }
    Ok(case)
}

/// Runs a reshard case through `handler` (the CPU send or receive handler,
/// as the case says) and checks what it got (see [`ReshardCase`]).
pub fn check_reshard_case(case: ReshardCase) -> std::result::Result<Outcome, String> {
    let ReshardCase { call, corruptions, mutated, send } = case;
    let valid = !mutated && corruptions.is_empty();
    let what = || format!("{call:?}, corruptions {corruptions:?}, mutated {mutated}");
    let mut frame = call.clone().build();
    if let Some(x) = frame.arg_data_mut(0).filter(|_| send) {
        x.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    }
    if let Some(id) = frame.arg_data_mut(usize::from(send)).filter(|id| id.len() == 4) {
        id.copy_from_slice(&RESHARD_CALL_ID.to_ne_bytes());
    }
    let site = call.attrs.iter().find_map(|(name, a)| match a {
        Attr::I64(site) if *name == "site" => Some(*site),
        _ => None,
    });
    let corrupted = corruptions.iter().filter(|&&c| frame.corrupt(c)).count() > 0;
    let well_formed = !corrupted && frame.allocated();
    let handler: Handler = if send {
        crate::exports::xla::commfuse_reshard_send_cpu
    } else {
        crate::exports::xla::commfuse_reshard_receive_cpu
    };
    let result = every_frame_checks(frame.call(handler), corrupted, well_formed, &what);
    // What a send posted for receivers that never come goes (as when
    // Python drops an unreceived handle).
    if let Some(site) = site {
        crate::backend::cpu::transport::abandon(site, RESHARD_CALL_ID.into());
    }
    let outcome = result?.map_or(Outcome::Success, |(code, _)| Outcome::Error(code));
    let expected = if send { Outcome::Success } else { Outcome::Error(sys::XLA_FFI_Error_Code_DEADLINE_EXCEEDED) };
    if valid && outcome != expected {
        return Err(format!(
            "a valid {} got {outcome:?}, expected {expected:?} ({})",
            if send { "send" } else { "receive" },
            what()
        ));
    }
    Ok(outcome)
}

/// One reshard frame case from `data`; panics saying what broke
/// (`fuzz/fuzz_targets/reshard_frame.rs`). Sets the process's deadline to `FUZZ_TIMEOUT`.
pub fn reshard_frame_target(data: &[u8]) {
    crate::config::set_timeout(Some(FUZZ_TIMEOUT));
    let Ok(case) = reshard_case(&mut Unstructured::new(data)) else { return };
    if let Err(e) = check_reshard_case(case) {
        panic!("{e}");
    }
}

/// One planner case: an op's shapes and schedule over a group, checked
/// and planned as a call would be.
#[derive(Debug)]
pub struct PlannerCase {
    /// What Python would send at trace time.
    pub shapes: CallShapes,
    /// The result's dims as the frame gives them (possibly inconsistent).
    pub out: Vec<i64>,
    /// This rank's place in the group.
    pub rank: usize,
}

/// A planner case from `u`: mostly small consistent sizes, sometimes any.
pub fn planner_case(u: &mut Unstructured) -> Result<PlannerCase> {
    let mut case = valid_call(u)?;
    if u.ratio(1u8, 2)? {
        mutate(u, &mut case.call)?;
    }
    let attr = |name: &str| {
        case.call.attrs.iter().find(|(n, _)| *n == name).and_then(|(_, a)| match a {
            Attr::I64(v) => Some(*v),
            _ => None,
        })
    };
    let mut ranks = case.ranks as i64;
    if u.ratio(1u8, 16)? {
        ranks = interesting(u)?;
    }
    let dims = |list: &[(u32, Vec<i64>)], i: usize| list.get(i).map(|(_, d)| d.clone()).unwrap_or_default();
    let dtype = |list: &[(u32, Vec<i64>)], i: usize| list.get(i).map_or(F32, |(d, _)| *d);
    let shapes = CallShapes {
        kind: attr("kind").unwrap_or(0),
        schedule: attr("schedule").unwrap_or(0),
        ranks,
        dimension: attr("dimension").unwrap_or(0),
        x: dims(&case.call.args, 0),
        w: dims(&case.call.args, 1),
        input: dtype(&case.call.args, 0),
        output: dtype(&case.call.rets, 0),
    };
    Ok(PlannerCase { shapes, out: dims(&case.call.rets, 0), rank: u.int_in_range(0..=case.ranks - 1)? })
}

/// Prepares `case` as Python does at trace time and plans it as the
/// handlers do, with the result shape Python would then lower. Where the
/// trace-time answer succeeds the handler must plan the same call, within
/// the workspace the answer gave, and every GEMM of every step must stay
/// inside its buffers; where the handler plans the case's own result shape
/// the trace-time answer must have succeeded with it.
pub fn check_planner_case(case: &PlannerCase) -> std::result::Result<bool, String> {
    let PlannerCase { shapes, out, .. } = case;
    let CallShapes { kind, schedule, ranks, dimension, x, w, input, output } = shapes;
    let request =
        prepare::Request { call: shapes.clone(), machine: None, gemm_gflops: None, explain: false, trace: None };
    let planned = std::panic::catch_unwind(|| {
        let prepared = prepare::prepare(&request);
        let (Some(input), Some(output), Ok(ranks)) = (abi::dtype(*input), abi::dtype(*output), usize::try_from(*ranks))
        else {
            return Ok(None);
        };
        if ranks == 0 || case.rank >= ranks || ranks > crate::plan::MAX_RANKS {
            return Ok(None);
        }
        let (Ok(kind), Ok(schedule)) = (abi::kind(*kind), abi::kind(*kind).and_then(|k| abi::schedule(k, *schedule)))
        else {
            return Ok(None);
        };
        let group = Group { devices: (0..ranks as i64).collect(), rank: case.rank };
        let plan = |out: &[i64]| {
            call::problem_and_plan(kind, schedule, [(x, input), (w, input), (out, output)], *dimension, &group)
        };
        match prepared {
            Ok(prepared) => {
                let out: Vec<i64> = prepared.out.iter().map(|&d| d as i64).collect();
                match plan(&out) {
                    Ok((problem, plan)) => Ok(Some((problem, plan, prepared.workspace.cpu))),
                    Err(e) => Err(format!("prepared at trace time, but the handler refuses it: {e}")),
                }
            }
            Err(e) if plan(out).is_ok() => Err(format!("the handler plans it, but preparing it failed: {e}")),
            Err(_) => Ok(None),
        }
    });
    let Some((problem, plan, bytes)) = planned.map_err(|_| format!("a panic planning {case:?}"))?? else {
        return Ok(false);
    };
    let layout = CpuLayout::new(&problem).map_err(|e| format!("{e} for {case:?}"))?;
    if bytes < layout.total() {
        return Err(format!("the prepared workspace {bytes} < the CPU layout's {} for {case:?}", layout.total()));
    }
    if problem.is_trivial() {
        return Ok(true);
    }
    let sizes = problem.sizes();
    let slot_len = |i: usize| match plan.slots.get(i) {
        Some(SlotKind::Input) => sizes.travel,
        Some(SlotKind::Weight) => sizes.w,
        Some(SlotKind::Partial) => sizes.partial,
        Some(SlotKind::Result) => sizes.result,
        None => 0,
    };
    for step in &plan.steps {
        let Action::Matmul { block, src, with, dst, .. } = step.action else { continue };
        for g in problem.gemms(block, src, dst) {
            let side = |s: Side| match (s, src, with) {
                (Side::W, _, Buf::Slot(i)) | (Side::Src, Buf::Slot(i), _) => slot_len(i),
                (Side::W, _, _) => sizes.w,
                (Side::Src, _, _) => sizes.x,
            };
            let dst_len = match dst {
                Buf::Slot(i) => slot_len(i),
                _ => sizes.result,
            };
            let inside = |(len, v): (usize, View)| v.end() <= len;
            if !inside((side(g.lhs.0), g.lhs.1)) || !inside((side(g.rhs.0), g.rhs.1)) || !inside((dst_len, g.dst)) {
                return Err(format!("step {} reads or writes outside its buffers: {g:?} for {case:?}", step.id));
            }
            // The CPU backend packs the right-hand side into `rhs_len` elements.
            if g.rhs.1.rows * g.rhs.1.cols > problem.rhs_len() {
                return Err(format!("step {} multiplies by more than rhs_len: {g:?} for {case:?}", step.id));
            }
        }
    }
    Ok(true)
}

/// Deadline of the frame fuzzers' calls: a call whose peers never come
/// ends this long after the last progress.
pub const FUZZ_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(5);

/// One frame case from `data` through the CPU handler; panics saying what
/// broke (libFuzzer's crash, in `fuzz/fuzz_targets/frame.rs`). Sets the
/// process's deadline to `FUZZ_TIMEOUT`.
pub fn frame_target(data: &[u8]) {
    crate::config::set_timeout(Some(FUZZ_TIMEOUT));
    let Ok(case) = frame_case(&mut Unstructured::new(data)) else { return };
    if let Err(e) = check_frame_case(case, crate::exports::xla::commfuse_collective_matmul_cpu) {
        panic!("{e}");
    }
}

/// One planner case from `data`; panics saying what broke (`fuzz/fuzz_targets/planner.rs`).
pub fn planner_target(data: &[u8]) {
    let Ok(case) = planner_case(&mut Unstructured::new(data)) else { return };
    if let Err(e) = check_planner_case(&case) {
        panic!("{e}");
    }
}
