//! One XLA call of a fused op, decoded for either backend: the op, its
//! schedule, the group, the problem and this rank's plan (a `CallSite`,
//! decoded once per call site and device and kept, see `sites`), and the
//! deadline settings as they are when the call runs. Each backend's handler
//! (`backend::cpu::handler`, `backend::cuda::handler`) reads its buffers and
//! calls `Call::decode`.
#![forbid(unsafe_code)]

use crate::abi;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::plan::{self, Plan, Schedule};
use crate::problem::{OpKind, Operand, Problem};
use crate::sync::lock;
use crate::xla::Frame;
use std::any::Any;
use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The attributes of a fused op's call, as `python/commfuse/_fused.py`
/// lowers them (`_lower_target`): fixed for a compiled instance, so decoded
/// once per instance where XLA keeps instance state (`instantiate`), else
/// on every call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SiteAttrs {
    pub kind: i64,
    pub site: i64,
    pub schedule: i64,
    pub dimension: i64,
    pub mesh_devices: Vec<i64>,
    pub mesh_shape: Vec<i64>,
    pub axes: Vec<i64>,
}

impl SiteAttrs {
    pub fn decode(frame: &Frame<'_>) -> Result<SiteAttrs> {
        let array = |name| frame.attr_i64_array(name).map(<[i64]>::to_vec);
        Ok(SiteAttrs {
            kind: frame.attr_i64("kind")?,
            site: frame.attr_i64("site")?,
            schedule: frame.attr_i64("schedule")?,
            dimension: frame.attr_i64("dimension")?,
            mesh_devices: array("mesh_devices")?,
            mesh_shape: array("mesh_shape")?,
            axes: array("axes")?,
        })
    }
}

/// Operands x, w and result out: dims and dtype, as the backend read them.
pub type Operands = [(Vec<i64>, DType); 3];

fn owned([x, w, out]: [(&[i64], DType); 3]) -> Operands {
    [x, w, out].map(|(dims, dtype)| (dims.to_vec(), dtype))
}

/// All a call site decodes from: its attributes, this call's device id in
/// the mesh and its operands' shapes; so also the key its `CallSite` is
/// kept under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SiteKey {
    pub attrs: SiteAttrs,
    pub device: i64,
    pub operands: Operands,
}

/// What XLA keeps with one compiled instance of a fused op's call: its
/// attributes, decoded at INSTANTIATE, and the site each device's calls
/// decode to (a CPU instance serves every device of the process, a GPU
/// instance its own device).
struct SiteInstance {
    attrs: SiteAttrs,
    sites: Mutex<HashMap<i64, (Operands, Arc<CallSite>)>>,
}

impl SiteInstance {
    /// The site of `device`'s calls with `operands`, decoded on its first call.
    fn site(&self, device: i64, operands: [(&[i64], DType); 3]) -> Result<Arc<CallSite>> {
        let same = |kept: &Operands| kept.iter().zip(&operands).all(|(k, (dims, dtype))| k.0 == *dims && k.1 == *dtype);
        if let Some((kept, site)) = lock(&self.sites).get(&device) {
            if same(kept) {
                return Ok(site.clone());
            }
        }
        // Decoded outside the lock, as `sites::get_or_decode` does.
        let key = SiteKey { attrs: self.attrs.clone(), device, operands: owned(operands) };
        let site = Arc::new(CallSite::decode(&key)?);
        counts::add(&counts::INSTANCE_SITES);
        lock(&self.sites).insert(device, (key.operands, site.clone()));
        Ok(site)
    }
}

/// The sites an instance's state (`instance_state` of one of its calls)
/// holds, one per device that has called it; None for another state.
#[cfg(test)]
pub fn instance_sites(state: &(dyn Any + Send + Sync)) -> Option<usize> {
    state.downcast_ref::<SiteInstance>().map(|instance| lock(&instance.sites).len())
}

/// How call sites were kept in this process, for tests and benchmarks:
/// instances whose state XLA keeps, sites decoded into them, and sites
/// decoded into the process's map (`sites`).
pub mod counts {
    use std::sync::atomic::{AtomicU64, Ordering};

    pub static INSTANCES: AtomicU64 = AtomicU64::new(0);
    pub static INSTANCE_SITES: AtomicU64 = AtomicU64::new(0);
    pub static MAP_SITES: AtomicU64 = AtomicU64::new(0);

    pub(super) fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// (instances, sites decoded into instances, sites decoded into the map).
    pub fn now() -> [u64; 3] {
        [&INSTANCES, &INSTANCE_SITES, &MAP_SITES].map(|c| c.load(Ordering::Relaxed))
    }
}

/// The INSTANTIATE stage of a fused op's handler: its attributes decoded
/// and kept as the instance's state. Where they do not decode, or this XLA
/// keeps no state, nothing is kept: each call decodes them as it runs
/// (`sites`), and reports what does not decode.
pub fn instantiate(frame: &Frame<'_>) -> Result<()> {
    if let Ok(attrs) = SiteAttrs::decode(frame) {
        let instance = SiteInstance { attrs, sites: Mutex::new(HashMap::new()) };
        // An XLA without the state API runs on the process's map instead.
        if frame.set_instance_state(Box::new(instance)).is_ok() {
            counts::add(&counts::INSTANCES);
        }
    }
    Ok(())
}

/// What one call site decodes to on one device: everything a call needs but
/// its buffers and its clock.
#[derive(Debug)]
pub struct CallSite {
    pub kind: OpKind,
    /// The call site (the lowering's `site` attribute).
    pub site: i64,
    pub schedule: Schedule,
    pub group: Group,
    /// The problem as the schedule cuts it, and this rank's plan.
    pub problem: Problem,
    pub plan: Plan,
    /// All of this rank's GEMM work, in floating-point operations (`plan_flops`).
    pub flops: f64,
    /// What a backend derives from the site alone (`derived`).
    backend: Derived,
}

/// A backend's state of one site, made on its first call.
#[derive(Default)]
struct Derived(OnceLock<Arc<dyn Any + Send + Sync>>);

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() { "Derived(made)" } else { "Derived(not yet)" })
    }
}

impl CallSite {
    fn decode(key: &SiteKey) -> Result<CallSite> {
        let attrs = &key.attrs;
        let kind = abi::kind(attrs.kind)?;
        let schedule = abi::schedule(kind, attrs.schedule)?;
        let group = Group::from_mesh(&attrs.mesh_devices, &attrs.mesh_shape, &attrs.axes, key.device)?;
        let [x, w, out] = &key.operands;
        let dims = [(x.0.as_slice(), x.1), (w.0.as_slice(), w.1), (out.0.as_slice(), out.1)];
        let (problem, plan) = problem_and_plan(kind, schedule, dims, attrs.dimension, &group)?;
        let flops = plan_flops(&problem, &plan);
        Ok(CallSite { kind, site: attrs.site, schedule, group, problem, plan, flops, backend: Derived::default() })
    }

    /// What a backend derives from this site alone (the CUDA backend's
    /// lowered device operations), made by `make` on the site's first call
    /// and shared by its later calls. A site serves one backend, so one
    /// type; a failure is not kept (each call fails with it again).
    pub fn derived<T: Any + Send + Sync>(&self, make: impl FnOnce(&CallSite) -> Result<T>) -> Result<Arc<T>> {
        let wrong_type = || Error::Internal(format!("call site {} holds another backend's state", self.site));
        if let Some(made) = self.backend.0.get() {
            return made.clone().downcast::<T>().map_err(|_| wrong_type());
        }
        // Two calls of the site at once may both make it: the first kept wins.
        let made: Arc<dyn Any + Send + Sync> = Arc::new(make(self)?);
        let kept = self.backend.0.get_or_init(|| made).clone();
        kept.downcast::<T>().map_err(|_| wrong_type())
    }
}

/// One call: its decoded site (shared with every other call of the site)
/// and what is read when XLA calls the handler.
pub struct Call {
    pub decoded: Arc<CallSite>,
    /// How long a wait may go without progress (`config::timeout`).
    pub timeout: Duration,
    /// When XLA called the handler: host waits that have no progress to
    /// count (creating a group's communicators) end at `deadline()`.
    pub started: Instant,
    /// `config::interrupts()` when XLA called the handler.
    pub interrupts: u64,
}

impl Deref for Call {
    type Target = CallSite;

    fn deref(&self) -> &CallSite {
        &self.decoded
    }
}

impl Call {
    /// The call of `frame` for operands `x`, `w` and result `out` (dims and
    /// dtype, as the backend read them), with `device` this call's device id
    /// in the mesh. The site's plan is made once: kept in XLA's instance
    /// state where XLA keeps one (`instantiate`), else in the process's map
    /// (`sites`).
    pub fn decode(frame: &Frame<'_>, operands: [(&[i64], DType); 3], device: i64) -> Result<Call> {
        let started = Instant::now();
        let interrupts = crate::config::interrupts();
        let decoded = match frame.instance_state().and_then(|state| state.downcast_ref::<SiteInstance>()) {
            Some(instance) => instance.site(device, operands)?,
            None => {
                let key = SiteKey { attrs: SiteAttrs::decode(frame)?, device, operands: owned(operands) };
                sites::get_or_decode(key)?
            }
        };
        Ok(Call { decoded, timeout: crate::config::timeout()?, started, interrupts })
    }

    /// The user's names of operands 0 and 1 of `frame`'s call (see
    /// `OpKind::operand_names`), for errors about its buffers.
    pub fn operand_names(frame: &Frame<'_>) -> [&'static str; 2] {
        let kind = frame.attr_i64("kind").and_then(abi::kind);
        kind.map_or(["x", "w"], OpKind::operand_names)
    }

    pub fn deadline(&self) -> Instant {
        self.started + self.timeout
    }
}

/// The decoded call sites of this process, by `SiteKey`. A site's
/// attributes and shapes are fixed once lowered, so its plan is made on its
/// first call and shared by the later ones (a plan of N ranks is O(N)
/// steps: made per call it would cost each call that much again). Bounded:
/// when full it starts over, so a process that lowers programs forever
/// keeps only recent sites.
pub mod sites {
    use super::{CallSite, SiteKey};
    use crate::error::Result;
    use crate::sync::lock;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    /// The most sites kept (every device of a site is one).
    pub const MOST: usize = 4096;

    fn cache() -> &'static Mutex<HashMap<SiteKey, Arc<CallSite>>> {
        static CACHE: OnceLock<Mutex<HashMap<SiteKey, Arc<CallSite>>>> = OnceLock::new();
        CACHE.get_or_init(Default::default)
    }

    /// The site `key` describes, decoded on its first call. A key that
    /// does not decode is not kept: each call fails with its error again.
    pub fn get_or_decode(key: SiteKey) -> Result<Arc<CallSite>> {
        if let Some(site) = lock(cache()).get(&key) {
            return Ok(site.clone());
        }
        // Decoded outside the lock: other devices' calls need not wait for it.
        let site = Arc::new(CallSite::decode(&key)?);
        super::counts::add(&super::counts::MAP_SITES);
        let mut cache = lock(cache());
        if cache.len() >= MOST {
            cache.clear();
        }
        Ok(cache.entry(key).or_insert(site).clone())
    }

    #[cfg(test)]
    pub fn contains(key: &SiteKey) -> bool {
        lock(cache()).contains_key(key)
    }
}

/// The problem one call describes (operands x, w, out as (dims, dtype)), cut
/// as `schedule` cuts it, and the plan of `group`'s rank; the plan's size
/// checked before it is made.
pub fn problem_and_plan(
    kind: OpKind,
    schedule: Schedule,
    [x, w, out]: [(&[i64], DType); 3],
    dimension: i64,
    group: &Group,
) -> Result<(Problem, Plan)> {
    let operand = |(dims, dtype)| Operand { dims, dtype };
    plan::check_size(kind.name(), schedule, group.size())?;
    let problem = Problem::new(kind, operand(x), operand(w), operand(out), dimension, group.size())?;
    let problem = problem.for_schedule(schedule)?;
    let pattern = problem.pattern();
    Ok((problem, plan::plan(pattern, schedule, group.size(), group.rank)))
}

/// All of one rank's GEMM work in `plan`, in floating-point operations (2 per multiply-add).
pub fn plan_flops(problem: &Problem, plan: &Plan) -> f64 {
    plan.steps
        .iter()
        .filter_map(|step| match step.action {
            plan::Action::Matmul { block, src, dst, .. } => Some(problem.gemms(block, src, dst)),
            _ => None,
        })
        .flatten()
        .map(|g| 2.0 * g.lhs.1.rows as f64 * g.lhs.1.cols as f64 * g.rhs.1.cols as f64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(site: i64, device: i64, rows: i64) -> SiteKey {
        SiteKey {
            attrs: SiteAttrs {
                kind: 0,
                site,
                schedule: 1,
                dimension: 0,
                mesh_devices: vec![10, 11, 12, 13],
                mesh_shape: vec![4],
                axes: vec![0],
            },
            device,
            operands: [(vec![rows, 8], DType::F32), (vec![8, 4], DType::F32), (vec![4 * rows, 4], DType::F32)],
        }
    }

    #[test]
    fn a_site_is_decoded_once_and_shared_by_its_calls() {
        let first = sites::get_or_decode(key(-501, 11, 2)).unwrap();
        let again = sites::get_or_decode(key(-501, 11, 2)).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!((first.group.rank, first.kind), (1, OpKind::AllGatherMatmul));
        // Another device, or other shapes, is another site.
        let other_device = sites::get_or_decode(key(-501, 12, 2)).unwrap();
        let other_shapes = sites::get_or_decode(key(-501, 11, 3)).unwrap();
        assert!(!Arc::ptr_eq(&first, &other_device) && !Arc::ptr_eq(&first, &other_shapes));
        assert_eq!(other_device.group.rank, 2);
    }

    #[test]
    fn a_backend_derives_its_state_once_per_site() {
        let site = sites::get_or_decode(key(-503, 10, 2)).unwrap();
        let made = std::sync::atomic::AtomicUsize::new(0);
        let make = |s: &CallSite| {
            made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(s.plan.steps.len())
        };
        let first = site.derived(make).unwrap();
        let again = site.derived(make).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!((*first, made.into_inner()), (site.plan.steps.len(), 1));
        assert!(site.derived(|_| Ok(1.5f64)).is_err(), "another type is refused, not transmuted");
        // A failure is not kept.
        let fresh = sites::get_or_decode(key(-504, 10, 2)).unwrap();
        assert!(fresh.derived::<u8>(|_| Err(Error::Internal("no".into()))).is_err());
        assert_eq!(*fresh.derived(|_| Ok(7u8)).unwrap(), 7);
    }

    #[test]
    fn a_site_that_does_not_decode_fails_every_call_and_is_not_kept() {
        let bad = key(-502, 99, 2); // device 99 is not in the mesh
        for _ in 0..2 {
            let e = sites::get_or_decode(bad.clone()).unwrap_err();
            assert!(e.to_string().contains("not in the mesh"), "{e}");
            assert!(!sites::contains(&bad));
        }
    }
}
