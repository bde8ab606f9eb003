//! The one lock helper: a panic while a lock was held (caught at the FFI
//! edge or in a worker) must not poison every later call, and every piece
//! of state behind these locks is updated in single steps that leave it
//! consistent, so a poisoned lock is simply taken.
#![forbid(unsafe_code)]

use std::sync::{Condvar, Mutex, MutexGuard, WaitTimeoutResult};
use std::time::Duration;

pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `Condvar::wait`, ignoring poison as `lock` does.
pub fn wait<'a, T>(c: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    c.wait(guard).unwrap_or_else(|e| e.into_inner())
}

/// `Condvar::wait_timeout`, ignoring poison as `lock` does.
pub fn wait_timeout<'a, T>(
    c: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
    c.wait_timeout(guard, timeout).unwrap_or_else(|e| e.into_inner())
}
