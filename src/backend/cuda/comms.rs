//! Communicators: one per group of devices, created once and cached.
//!
//! The key is the group's device ids in rank order (`comm::Group::devices`),
//! which every member computes identically from the mesh: the same TP group
//! of a multi-axis mesh gets one communicator, another axis or another slice
//! of the mesh gets its own, and rank order matters (it decides NCCL ranks).
//! In one process the communicators of all local members are created
//! together (`ncclCommInitAll` style); across processes the unique id is
//! exchanged through the JAX distributed key-value store under
//! [`CommKey::store_key`].
#![forbid(unsafe_code)]

use crate::comm::Group;
use crate::error::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Identifies one communicator: the group's global device ids in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommKey {
    pub devices: Vec<i64>,
}

impl CommKey {
    pub fn of(group: &Group) -> CommKey {
        CommKey { devices: group.devices.clone() }
    }

    /// The key under which the group's NCCL unique id is published in the
    /// distributed key-value store (multi-process): the same on every member.
    pub fn store_key(&self) -> String {
        let ids: Vec<String> = self.devices.iter().map(|d| d.to_string()).collect();
        format!("commfuse/nccl_id/{}", ids.join("_"))
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
/// members of a group ask at the same time (`create` runs under the lock,
/// outside the hot path: only the first call of a group pays for it).
pub struct CommCache<C> {
    entries: Mutex<HashMap<CommKey, Arc<C>>>,
}

impl<C> Default for CommCache<C> {
    fn default() -> Self {
        CommCache { entries: Mutex::new(HashMap::new()) }
    }
}

impl<C> CommCache<C> {
    /// The cached value of `key`, or the one `create` makes (a failure is not cached).
    pub fn get_or_create(&self, key: &CommKey, create: impl FnOnce() -> Result<C>) -> Result<Arc<C>> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = entries.get(key) {
            return Ok(Arc::clone(c));
        }
        let c = Arc::new(create()?);
        entries.insert(key.clone(), Arc::clone(&c));
        Ok(c)
    }

    /// Drops `key`'s entry if it is still `failed` (a communicator that
    /// failed; one made since by another member stays); the next
    /// `get_or_create` makes a new one. Holders of the old `Arc` keep it.
    pub fn remove(&self, key: &CommKey, failed: &Arc<C>) -> bool {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.get(key).is_some_and(|c| Arc::ptr_eq(c, failed)) {
            entries.remove(key);
            return true;
        }
        false
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    // A 2x4 ("dp", "tp") mesh with shuffled ids, as in `comm`'s tests.
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
        let created = std::sync::atomic::AtomicUsize::new(0);
        let make = || Ok(created.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
        std::thread::scope(|s| {
            for &d in &IDS {
                let (cache, make) = (&cache, &make);
                s.spawn(move || cache.get_or_create(&key(&[1], d), make).unwrap());
            }
        });
        assert_eq!(cache.len(), 2);
        assert_eq!(created.load(std::sync::atomic::Ordering::SeqCst), 2);
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
}
