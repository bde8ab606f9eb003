//! Communicators: one per group of devices, created once and cached.
//!
//! The key is the group's device ids in rank order (`group::Group::devices`),
//! which every member computes identically from the mesh: the same TP group
//! of a multi-axis mesh gets one communicator, another axis or another slice
//! of the mesh gets its own, and rank order matters (it decides NCCL ranks).
//! In one process the communicators of all local members are created
//! together (`ncclCommInitAll` style); across processes the unique id is
//! exchanged through the JAX distributed key-value store under
//! [`CommKey::store_key`].
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::group::Group;
use crate::sync::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Identifies one communicator: the group's global device ids in rank
/// order, and what it carries.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommKey {
    pub devices: Vec<i64>,
    pub purpose: Purpose,
}

/// What a communicator carries. NCCL pairs point-to-point transfers in the
/// order each rank posts them, so traffic that ranks post in different
/// orders relative to each other must not share a communicator: a
/// reshard's sends are posted by its send program, whenever the source
/// mesh runs it, while a fused op of the same devices posts in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Purpose {
    FusedOps,
    Reshard,
}

impl CommKey {
    pub fn of(group: &Group) -> CommKey {
        CommKey::fused_ops(group.devices.clone())
    }

    pub fn fused_ops(devices: Vec<i64>) -> CommKey {
        CommKey { devices, purpose: Purpose::FusedOps }
    }

    /// The communicator of reshards over the union `devices` of two meshes.
    pub fn reshard(devices: Vec<i64>) -> CommKey {
        CommKey { devices, purpose: Purpose::Reshard }
    }

    /// The key under which the group's NCCL unique id is published in the
    /// distributed key-value store (multi-process): the same on every member.
    pub fn store_key(&self) -> String {
        let ids: Vec<String> = self.devices.iter().map(|d| d.to_string()).collect();
        let kind = match self.purpose {
            Purpose::FusedOps => "nccl_id",
            Purpose::Reshard => "reshard_nccl_id",
        };
        format!("commfuse/{kind}/{}", ids.join("_"))
    }

    /// Ranks of this group's devices that live in this process, given the
    /// process's local device ids: these communicators are created together.
    pub fn local_ranks(&self, local_devices: &[i64]) -> Vec<usize> {
        self.devices.iter().enumerate().filter(|(_, d)| local_devices.contains(d)).map(|(r, _)| r).collect()
    }

    /// Whether the whole group lives in this process (no key-value exchange needed).
    pub fn is_local(&self, local_devices: &[i64]) -> bool {
        self.local_ranks(local_devices).len() == self.devices.len()
    }
}

/// A process-wide cache: one entry per key, each created once even when the
/// members of a group ask at the same time.
///
/// A creation can take until the call's deadline (NCCL waits for every
/// member), so it runs under its key's own lock, never under the map's: a
/// call of an already cached group only takes the map's lock for a lookup.
/// Callers of the key being created wait for that creation and take its
/// result (or, if it failed, try once more themselves).
pub struct CommCache<C> {
    entries: Mutex<HashMap<CommKey, Arc<Entry<C>>>>,
}

/// One key's value once made, and the lock its creators take.
struct Entry<C> {
    value: OnceLock<Arc<C>>,
    creating: Mutex<()>,
}

impl<C> Default for CommCache<C> {
    fn default() -> Self {
        CommCache { entries: Mutex::new(HashMap::new()) }
    }
}

impl<C> CommCache<C> {
    /// The cached value of `key`, or the one `create` makes (a failure is
    /// not cached: the next call tries again).
    pub fn get_or_create(&self, key: &CommKey, create: impl FnOnce() -> Result<C>) -> Result<Arc<C>> {
        let entry = {
            let mut entries = lock(&self.entries);
            // Look up before inserting: the hot path clones no key.
            match entries.get(key) {
                Some(e) => Arc::clone(e),
                None => {
                    let e = Arc::new(Entry { value: OnceLock::new(), creating: Mutex::new(()) });
                    entries.insert(key.clone(), Arc::clone(&e));
                    e
                }
            }
        };
        if let Some(c) = entry.value.get() {
            return Ok(Arc::clone(c));
        }
        let _creating = lock(&entry.creating);
        // Made by the creator this call waited for.
        if let Some(c) = entry.value.get() {
            return Ok(Arc::clone(c));
        }
        let c = Arc::new(create()?);
        // Only holders of `creating` set the value, and it was empty.
        let _ = entry.value.set(Arc::clone(&c));
        Ok(c)
    }

    /// The cached value of `key`, if one was made (none is created).
    pub fn get(&self, key: &CommKey) -> Option<Arc<C>> {
        lock(&self.entries).get(key).and_then(|e| e.value.get().cloned())
    }

    /// Drops `key`'s entry if it is still `failed` (a communicator that
    /// failed; one made since by another member stays); the next
    /// `get_or_create` makes a new one. Holders of the old `Arc` keep it.
    pub fn remove(&self, key: &CommKey, failed: &Arc<C>) -> bool {
        let mut entries = lock(&self.entries);
        if entries.get(key).and_then(|e| e.value.get()).is_some_and(|c| Arc::ptr_eq(c, failed)) {
            entries.remove(key);
            return true;
        }
        false
    }

    /// Number of keys with a value (creations in progress or failed are not counted).
    pub fn len(&self) -> usize {
        lock(&self.entries).values().filter(|e| e.value.get().is_some()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes of an `ncclUniqueId`.
pub const NCCL_ID_BYTES: usize = 128;
/// The id travels in an FFI attribute as this many little-endian int64 words.
pub const NCCL_ID_WORDS: usize = NCCL_ID_BYTES / 8;

/// An NCCL unique id as the 16 little-endian int64 words of its attribute.
pub fn id_to_words(id: &[u8; NCCL_ID_BYTES]) -> [i64; NCCL_ID_WORDS] {
    let mut words = [0i64; NCCL_ID_WORDS];
    for (w, chunk) in words.iter_mut().zip(id.chunks_exact(8)) {
        *w = i64::from_le_bytes(chunk.try_into().expect("8 bytes"));
    }
    words
}

/// The id in 16 words (see [`id_to_words`]).
pub fn id_from_words(words: &[i64]) -> Result<[u8; NCCL_ID_BYTES]> {
    if words.len() != NCCL_ID_WORDS {
        return Err(Error::InvalidArgument(format!(
            "an NCCL unique id is {NCCL_ID_WORDS} int64 words, got {}",
            words.len()
        )));
    }
    let mut id = [0u8; NCCL_ID_BYTES];
    for (chunk, w) in id.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    Ok(id)
}

/// Where the devices of a mesh live, from the lowering's optional
/// attributes for meshes spanning processes (Python's `_nccl_id`):
/// `local_ordinals` gives, per device of `mesh_devices` (same order), its
/// CUDA ordinal in this process or -1; `nccl_groups` concatenates the groups
/// (device ids in rank order) that span processes and have a member here,
/// and `nccl_ids` their unique ids, [`NCCL_ID_WORDS`] words each, exchanged
/// through the JAX distributed key-value store under [`CommKey::store_key`].
/// Without these attributes every mesh device is the CUDA device of the
/// same number in this process (the single-process case).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement<'a> {
    pub local_ordinals: Option<&'a [i64]>,
    pub groups: &'a [i64],
    pub ids: &'a [i64],
}

impl Placement<'_> {
    /// The mesh device id of the device XLA runs this call on (`ordinal`,
    /// XLA's device ordinal, a CUDA ordinal of this process).
    pub fn my_device(&self, mesh_devices: &[i64], ordinal: i32) -> Result<i64> {
        let Some(local) = self.local_ordinals else { return Ok(i64::from(ordinal)) };
        self.check_len(mesh_devices)?;
        let at = local.iter().position(|&o| o == i64::from(ordinal)).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "CUDA device {ordinal} of this process is not in the mesh (local_ordinals {local:?})"
            ))
        })?;
        Ok(mesh_devices[at])
    }

    /// Per rank of `key`'s group: the member's CUDA ordinal in this
    /// process, or `None` for a member of another process.
    pub fn members(&self, mesh_devices: &[i64], key: &CommKey, device_count: i32) -> Result<Vec<Option<i32>>> {
        let local = match self.local_ordinals {
            Some(l) => {
                self.check_len(mesh_devices)?;
                l
            }
            None => return local_members(key, device_count),
        };
        key.devices
            .iter()
            .map(|d| {
                let at = mesh_devices
                    .iter()
                    .position(|m| m == d)
                    .ok_or_else(|| Error::InvalidArgument(format!("device {d} of the group is not in the mesh")))?;
                match local[at] {
                    -1 => Ok(None),
                    o => match i32::try_from(o) {
                        Ok(o) if o >= 0 && o < device_count => Ok(Some(o)),
                        _ => Err(Error::InvalidArgument(format!(
                            "device {d} is mapped to CUDA device {o}, but this process has {device_count}"
                        ))),
                    },
                }
            })
            .collect()
    }

    /// The exchanged unique id of `key`'s group, which spans processes.
    pub fn id(&self, key: &CommKey) -> Result<[u8; NCCL_ID_BYTES]> {
        let n = key.devices.len();
        let missing = || {
            Error::Unimplemented(format!(
                "the group {:?} spans processes, but the call carries no NCCL unique id for it: the CUDA \
                 lowering must exchange one through the JAX distributed key-value store \
                 (commfuse._nccl_id.lowering_attributes) and pass it as the `nccl_ids` attribute",
                key.devices
            ))
        };
        if n == 0 || self.groups.len() % n != 0 || self.ids.len() != self.groups.len() / n * NCCL_ID_WORDS {
            return if self.groups.is_empty() && self.ids.is_empty() {
                Err(missing())
            } else {
                Err(Error::InvalidArgument(format!(
                    "nccl_groups ({} ids) and nccl_ids ({} words) do not describe groups of {n} devices",
                    self.groups.len(),
                    self.ids.len()
                )))
            };
        }
        let index = self.groups.chunks_exact(n).position(|g| g == key.devices.as_slice()).ok_or_else(missing)?;
        id_from_words(&self.ids[index * NCCL_ID_WORDS..(index + 1) * NCCL_ID_WORDS])
    }

    fn check_len(&self, mesh_devices: &[i64]) -> Result<()> {
        match self.local_ordinals {
            Some(l) if l.len() != mesh_devices.len() => Err(Error::InvalidArgument(format!(
                "local_ordinals has {} entries for {} mesh devices",
                l.len(),
                mesh_devices.len()
            ))),
            _ => Ok(()),
        }
    }
}

/// Single process: the group's device ids are this process's CUDA ordinals.
fn local_members(key: &CommKey, device_count: i32) -> Result<Vec<Option<i32>>> {
    key.devices
        .iter()
        .map(|&d| match i32::try_from(d) {
            Ok(o) if o >= 0 && o < device_count => Ok(Some(o)),
            _ => Err(Error::Unimplemented(format!(
                "device {d} of the group {:?} is not one of this process's {device_count} CUDA devices, and the \
                 call carries no placement (`local_ordinals`) saying where it lives: a mesh spanning processes \
                 needs the CUDA lowering to pass it (commfuse._nccl_id.lowering_attributes)",
                key.devices
            ))),
        })
        .collect()
}

/// Unique ids already used to create a communicator in this process. NCCL
/// ids are single use: a group spanning processes whose communicator failed
/// cannot be re-created with the id its lowering carried.
#[derive(Default)]
pub struct IdLedger {
    used: Mutex<Vec<[u8; NCCL_ID_BYTES]>>,
}

impl IdLedger {
    /// Records `id` for `key`'s group, or fails if it was used before.
    pub fn claim(&self, key: &CommKey, id: &[u8; NCCL_ID_BYTES]) -> Result<()> {
        let mut used = lock(&self.used);
        if used.contains(id) {
            return Err(Error::Unimplemented(format!(
                "the communicator of the group {:?} (spanning processes) failed earlier and NCCL unique ids are \
                 single use: re-creating it needs a fresh id from every process (restart the job)",
                key.devices
            )));
        }
        used.push(*id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    // A 2x4 ("dp", "tp") mesh with shuffled ids, as in `group`'s tests.
    const IDS: [i64; 8] = [5, 1, 7, 3, 0, 4, 2, 6];
    const SHAPE: [i64; 2] = [2, 4];

    fn key(axes: &[i64], device: i64) -> CommKey {
        CommKey::of(&Group::from_mesh(&IDS, &SHAPE, axes, device).unwrap())
    }

    #[test]
    fn every_member_of_a_group_computes_the_same_key_and_other_groups_differ() {
        for axes in [&[0][..], &[1], &[0, 1], &[1, 0]] {
            let mut keys: Vec<CommKey> = IDS.iter().map(|&d| key(axes, d)).collect();
            for &d in &IDS {
                let k = key(axes, d);
                assert!(k.devices.contains(&d));
                for &peer in &k.devices {
                    assert_eq!(key(axes, peer), k, "axes {axes:?}: {d} and {peer} disagree");
                }
            }
            keys.sort();
            keys.dedup();
            let groups = 8 / key(axes, IDS[0]).devices.len();
            assert_eq!(keys.len(), groups, "axes {axes:?}");
        }
        // Same devices in another rank order is another communicator.
        assert_ne!(key(&[0, 1], 4), key(&[1, 0], 4));
        assert_eq!(key(&[1], 4).store_key(), "commfuse/nccl_id/0_4_2_6");
        // A reshard over the same devices has a communicator of its own.
        let reshard = CommKey::reshard(key(&[1], 4).devices);
        assert_ne!(reshard, key(&[1], 4));
        assert_eq!(reshard.store_key(), "commfuse/reshard_nccl_id/0_4_2_6");
    }

    #[test]
    fn local_ranks_follow_the_process_devices() {
        let k = key(&[1], 4); // devices [0, 4, 2, 6]
        assert_eq!(k.local_ranks(&[0, 1, 2, 3]), vec![0, 2]);
        assert!(!k.is_local(&[0, 1, 2, 3]));
        assert!(k.is_local(&[0, 1, 2, 3, 4, 5, 6, 7]));
    }

    #[test]
    fn the_cache_creates_each_communicator_once_and_does_not_cache_failures() {
        let cache: CommCache<usize> = CommCache::default();
        let created = AtomicUsize::new(0);
        let make = || Ok(created.fetch_add(1, Ordering::SeqCst));
        std::thread::scope(|s| {
            for &d in &IDS {
                let (cache, make) = (&cache, &make);
                s.spawn(move || cache.get_or_create(&key(&[1], d), make).unwrap());
            }
        });
        assert_eq!(cache.len(), 2);
        assert_eq!(created.load(Ordering::SeqCst), 2);
        let k = key(&[0], 4);
        let e = cache.get_or_create(&k, || Err(Error::Internal("init failed".into()))).unwrap_err();
        assert_eq!(e.message(), "init failed");
        assert_eq!(cache.len(), 2);
        assert_eq!(*cache.get_or_create(&k, || Ok(7)).unwrap(), 7);
        // An evicted entry is created afresh; a stale eviction leaves the new one.
        let seven = cache.get_or_create(&k, || Ok(0)).unwrap();
        assert!(cache.remove(&k, &seven));
        assert!(!cache.remove(&k, &seven));
        let eight = cache.get_or_create(&k, || Ok(8)).unwrap();
        assert!(!cache.remove(&k, &seven));
        assert!(Arc::ptr_eq(&cache.get_or_create(&k, || Ok(9)).unwrap(), &eight));
    }

    #[test]
    fn members_asking_together_wait_for_one_slow_creation() {
        let cache: CommCache<usize> = CommCache::default();
        let created = AtomicUsize::new(0);
        let k = key(&[1], 4);
        let got: Vec<usize> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        *cache
                            .get_or_create(&k, || {
                                std::thread::sleep(Duration::from_millis(30));
                                Ok(100 + created.fetch_add(1, Ordering::SeqCst))
                            })
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(created.load(Ordering::SeqCst), 1);
        assert_eq!(got, vec![100; 4]);
    }

    #[test]
    fn a_creation_in_progress_does_not_block_other_cached_groups() {
        let cache: CommCache<usize> = CommCache::default();
        let (a, b) = (key(&[1], 4), key(&[1], 5));
        cache.get_or_create(&b, || Ok(2)).unwrap();
        let (started_tx, started) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            let cache = &cache;
            let a = &a;
            let slow = s.spawn(move || {
                cache.get_or_create(a, || {
                    started_tx.send(()).unwrap();
                    // Bounded, so a regression fails the test instead of hanging it.
                    release_rx.recv_timeout(Duration::from_secs(10)).map(|()| 1).map_err(|_| {
                        Error::DeadlineExceeded("the cached group's lookup waited for this creation".into())
                    })
                })
            });
            started.recv_timeout(Duration::from_secs(10)).unwrap();
            // A's creation is in progress and holds A's lock: B is answered at once.
            let t = Instant::now();
            assert_eq!(*cache.get_or_create(&b, || Ok(99)).unwrap(), 2);
            assert_eq!(cache.len(), 1);
            assert!(t.elapsed() < Duration::from_secs(5));
            release.send(()).unwrap();
            assert_eq!(*slow.join().unwrap().unwrap(), 1);
        });
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn a_failed_creation_is_retried_by_the_member_that_waited_for_it() {
        let cache: CommCache<usize> = CommCache::default();
        let k = key(&[0], 3);
        let attempts = AtomicUsize::new(0);
        let (started_tx, started) = mpsc::channel();
        let results: Vec<Result<usize>> = std::thread::scope(|s| {
            let (cache, k, attempts) = (&cache, &k, &attempts);
            let first = s.spawn(move || {
                cache.get_or_create(k, || {
                    attempts.fetch_add(1, Ordering::SeqCst);
                    started_tx.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(30));
                    Err(Error::Internal("init failed".into()))
                })
            });
            started.recv_timeout(Duration::from_secs(10)).unwrap();
            let second = s.spawn(move || {
                cache.get_or_create(k, || {
                    attempts.fetch_add(1, Ordering::SeqCst);
                    Ok(5)
                })
            });
            [first, second].map(|h| h.join().unwrap().map(|c| *c)).into()
        });
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        assert_eq!(results[0], Err(Error::Internal("init failed".into())));
        assert_eq!(results[1], Ok(5));
        assert_eq!(*cache.get_or_create(&k, || Ok(6)).unwrap(), 5);
    }

    #[test]
    fn unique_ids_round_trip_through_attribute_words() {
        let mut id = [0u8; NCCL_ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 37 + 200) as u8;
        }
        let words = id_to_words(&id);
        assert_eq!(words[0], i64::from_le_bytes(id[..8].try_into().unwrap()));
        assert_eq!(id_from_words(&words).unwrap(), id);
        assert!(matches!(id_from_words(&words[1..]), Err(Error::InvalidArgument(_))));
    }

    // Two processes of 4 GPUs each; the mesh is the 2x4 one above and this
    // process holds the devices 0..4 (ids) on CUDA ordinals 3, 2, 1, 0.
    const LOCAL: [i64; 8] = [-1, 2, -1, 0, 3, -1, 1, -1];

    #[test]
    fn placement_maps_xla_ordinals_and_group_members_to_this_process() {
        let p = Placement { local_ordinals: Some(&LOCAL), ..Default::default() };
        assert_eq!(p.my_device(&IDS, 3).unwrap(), 0);
        assert_eq!(p.my_device(&IDS, 0).unwrap(), 3);
        assert!(matches!(p.my_device(&IDS, 4), Err(Error::InvalidArgument(_))));
        // The "tp" group of device 0 is [0, 4, 2, 6]: 0 and 2 live here.
        let k = key(&[1], p.my_device(&IDS, 3).unwrap());
        assert_eq!(p.members(&IDS, &k, 4).unwrap(), vec![Some(3), None, Some(1), None]);
        // The "dp" group of device 3 is [3, 6]: 3 is here on ordinal 0.
        assert_eq!(p.members(&IDS, &key(&[0], 3), 4).unwrap(), vec![Some(0), None]);
        assert!(matches!(p.members(&IDS, &k, 2), Err(Error::InvalidArgument(_))));
        let short = Placement { local_ordinals: Some(&LOCAL[1..]), ..Default::default() };
        assert!(matches!(short.my_device(&IDS, 0), Err(Error::InvalidArgument(_))));
        // Without placement: ids are CUDA ordinals, others are UNIMPLEMENTED.
        let none = Placement::default();
        assert_eq!(none.my_device(&IDS, 2).unwrap(), 2);
        assert_eq!(none.members(&IDS, &k, 8).unwrap(), vec![Some(0), Some(4), Some(2), Some(6)]);
        let e = none.members(&IDS, &k, 4).unwrap_err();
        assert!(matches!(e, Error::Unimplemented(_)) && e.message().contains("local_ordinals"), "{e}");
    }

    #[test]
    fn each_group_finds_its_own_exchanged_id() {
        let (a, b) = (key(&[1], 4), key(&[1], 5)); // [0, 4, 2, 6] and [5, 1, 7, 3]
        let (ia, ib) = ([1u8; NCCL_ID_BYTES], [2u8; NCCL_ID_BYTES]);
        let groups: Vec<i64> = b.devices.iter().chain(&a.devices).copied().collect();
        let ids: Vec<i64> = id_to_words(&ib).iter().chain(&id_to_words(&ia)).copied().collect();
        let p = Placement { local_ordinals: Some(&LOCAL), groups: &groups, ids: &ids };
        assert_eq!(p.id(&a).unwrap(), ia);
        assert_eq!(p.id(&b).unwrap(), ib);
        // Another group, or the same devices in another order, has no id.
        let e = p.id(&CommKey::fused_ops(vec![0, 2, 4, 6])).unwrap_err();
        assert!(matches!(e, Error::Unimplemented(_)) && e.message().contains("nccl_ids"), "{e}");
        assert!(matches!(p.id(&key(&[0], 3)), Err(Error::InvalidArgument(_))));
        let bad = Placement { ids: &ids[1..], ..p.clone() };
        assert!(matches!(bad.id(&a), Err(Error::InvalidArgument(_))));
        assert!(matches!(Placement::default().id(&a), Err(Error::Unimplemented(_))));
    }

    #[test]
    fn an_id_creates_one_communicator_only() {
        let ledger = IdLedger::default();
        let k = key(&[1], 4);
        ledger.claim(&k, &[7; NCCL_ID_BYTES]).unwrap();
        ledger.claim(&k, &[8; NCCL_ID_BYTES]).unwrap();
        let e = ledger.claim(&k, &[7; NCCL_ID_BYTES]).unwrap_err();
        assert!(matches!(e, Error::Unimplemented(_)) && e.message().contains("single use"), "{e}");
    }
}
