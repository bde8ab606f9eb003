//! Which commfuse calls each device of this process is in right now, and
//! when it last left one: what a deadline error can say for certain about a
//! peer that never arrived (it is in no commfuse call at all, or it is
//! inside another one), instead of guessing why.
//!
//! A handler enters when XLA calls it and leaves when its work ends, before
//! XLA's future completes (completing it runs XLA's continuation of the
//! device's program, which is no longer commfuse's). Entering and leaving
//! each take one short lock; a device's record allocates nothing once it
//! has held as many calls at once as the device ever runs (usually one).
#![forbid(unsafe_code)]

use crate::sync::lock;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One commfuse call of a device, as its frame names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallIdentity {
    /// The op's name (`OpKind::name`, or "reshard send" / "reshard receive").
    pub kind: &'static str,
    /// The call site (the lowering's `site` attribute).
    pub site: i64,
    /// XLA's run id of the program execution, where XLA gives one.
    pub run: Option<i64>,
    /// How many calls of this site the device made before it in the same run
    /// (a site inside `lax.scan` runs once per iteration); 0 where not counted.
    pub sequence: u64,
}

impl CallIdentity {
    /// Whether `self` and `other` are the same execution of one call site
    /// (the op's name aside: the site decides it).
    fn same_execution(&self, other: &CallIdentity) -> bool {
        (self.site, self.run, self.sequence) == (other.site, other.run, other.sequence)
    }
}

impl fmt::Display for CallIdentity {
    /// "call site 7, kind all_gather_matmul, run 42" (", its call 3 of that
    /// site in the run" after the first).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "call site {}, kind {}", self.site, self.kind)?;
        if let Some(run) = self.run {
            write!(f, ", run {run}")?;
        }
        if self.sequence > 0 {
            write!(f, ", its call {} of that site in the run", self.sequence + 1)?;
        }
        Ok(())
    }
}

/// A call in progress: `token` tells it apart from the device's other calls.
struct InProgress {
    token: u64,
    call: CallIdentity,
    entered: Instant,
}

#[derive(Default)]
struct DeviceRecord {
    /// Calls entered and not yet left, oldest first.
    inside: Vec<InProgress>,
    /// The call the device left last, and when.
    last_left: Option<(CallIdentity, Instant)>,
}

fn devices() -> &'static Mutex<HashMap<i64, DeviceRecord>> {
    static DEVICES: OnceLock<Mutex<HashMap<i64, DeviceRecord>>> = OnceLock::new();
    DEVICES.get_or_init(Default::default)
}

/// Device `device` is inside `call` until this is dropped.
#[must_use = "the device leaves the call when this is dropped"]
pub struct Inside {
    device: i64,
    token: u64,
}

/// Records that `device` entered `call` now; it leaves when the result is dropped.
pub fn enter(device: i64, call: CallIdentity) -> Inside {
    static NEXT_TOKEN: AtomicU64 = AtomicU64::new(0);
    let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
    let entered = Instant::now();
    lock(devices()).entry(device).or_default().inside.push(InProgress { token, call, entered });
    Inside { device, token }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut devices = lock(devices());
        let Some(record) = devices.get_mut(&self.device) else { return };
        if let Some(i) = record.inside.iter().position(|c| c.token == self.token) {
            let left = record.inside.remove(i);
            record.last_left = Some((left.call, now));
        }
    }
}

/// Where a device is, as far as commfuse knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whereabouts {
    /// It has not entered any commfuse call in this process.
    Never,
    /// It is in no commfuse call: it left `last` `ago`, and entered none since.
    Outside { last: CallIdentity, ago: Duration },
    /// It is inside these calls (oldest first), each for how long so far.
    Inside(Vec<(CallIdentity, Duration)>),
}

/// Where `device` is now.
pub fn whereabouts(device: i64) -> Whereabouts {
    let now = Instant::now();
    let devices = lock(devices());
    let Some(record) = devices.get(&device) else { return Whereabouts::Never };
    if !record.inside.is_empty() {
        return Whereabouts::Inside(
            record.inside.iter().map(|c| (c.call, now.saturating_duration_since(c.entered))).collect(),
        );
    }
    match record.last_left {
        Some((last, left)) => Whereabouts::Outside { last, ago: now.saturating_duration_since(left) },
        None => Whereabouts::Never,
    }
}

/// What a deadline error says of one missing device; devices with the same
/// are named together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Situation {
    Never,
    /// Outside commfuse since it left this call.
    Left(CallIdentity),
    /// Entered the very call that waits for it, and has not joined its peers.
    Joining,
    /// Inside this other call (its oldest), and in `usize` later ones.
    Elsewhere(CallIdentity, usize),
}

/// For a deadline error of call `waiting` (the waiting device's own call,
/// which the devices of `missing` never joined): where those devices are,
/// one clause per situation, e.g. "devices [11, 12] have not entered any
/// commfuse call in this process; device 13 is inside another commfuse call
/// (call site 7, kind matmul_reduce_scatter, run 3) since 2150 ms ago".
pub fn describe_missing(missing: &[i64], waiting: &CallIdentity) -> String {
    /// Past this many clauses the rest are only counted: a message, not a table.
    const DESCRIBED: usize = 8;
    // Per situation, first seen first: its devices and the range of how long ago.
    let mut groups: Vec<(Situation, Vec<i64>, u128, u128)> = vec![];
    for &device in missing {
        let (situation, ms) = match whereabouts(device) {
            Whereabouts::Never => (Situation::Never, 0),
            Whereabouts::Outside { last, ago } => (Situation::Left(last), ago.as_millis()),
            Whereabouts::Inside(calls) => {
                // The oldest is the one it is held in: a device's calls start in program order.
                let (call, since) = calls[0];
                let situation = if call.same_execution(waiting) {
                    Situation::Joining
                } else {
                    Situation::Elsewhere(call, calls.len() - 1)
                };
                (situation, since.as_millis())
            }
        };
        match groups.iter_mut().find(|g| g.0 == situation) {
            // A device can hold two ranks of a session (a reshard's send and receive parts).
            Some(group) if group.1.contains(&device) => {}
            Some(group) => {
                group.1.push(device);
                group.2 = group.2.min(ms);
                group.3 = group.3.max(ms);
            }
            None => groups.push((situation, vec![device], ms, ms)),
        }
    }
    groups.sort_by_key(|g| g.0 != Situation::Never);
    let mut clauses: Vec<String> = groups
        .iter()
        .map(|(situation, devices, low, high)| {
            let who = match devices.as_slice() {
                [device] => format!("device {device}"),
                devices => format!("devices {devices:?}"),
            };
            let (has, is) = if devices.len() == 1 { ("has", "is") } else { ("have", "are") };
            let ms = if low == high { format!("{low} ms") } else { format!("{low} to {high} ms") };
            match situation {
                Situation::Never => format!("{who} {has} not entered any commfuse call in this process"),
                Situation::Left(last) => {
                    format!("{who} {has} not entered any commfuse call since leaving one {ms} ago ({last})")
                }
                // Its handler ran, but its part has not reached the peers.
                Situation::Joining => format!("{who} entered this call {ms} ago but {has} not joined its peers"),
                Situation::Elsewhere(call, 0) => {
                    format!("{who} {is} inside another commfuse call ({call}) since {ms} ago")
                }
                Situation::Elsewhere(call, later) => format!(
                    "{who} {is} inside another commfuse call ({call}) since {ms} ago, and in {later} later one(s)"
                ),
            }
        })
        .collect();
    let more = clauses.len().saturating_sub(DESCRIBED);
    clauses.truncate(DESCRIBED);
    let mut text = clauses.join("; ");
    if more > 0 {
        text.push_str(&format!("; {more} more situations not described"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    // Device ids from 5000 up: the registry is process-wide and tests run at once.
    fn call(site: i64, kind: &'static str) -> CallIdentity {
        CallIdentity { kind, site, run: Some(3), sequence: 0 }
    }

    #[test]
    fn a_device_that_never_entered_is_never_seen() {
        assert_eq!(whereabouts(5000), Whereabouts::Never);
    }

    #[test]
    fn a_device_is_inside_a_call_until_it_leaves_then_outside_since_then() {
        let inside = enter(5001, call(7, "all_gather_matmul"));
        let Whereabouts::Inside(calls) = whereabouts(5001) else { panic!("{:?}", whereabouts(5001)) };
        assert_eq!(calls.iter().map(|c| c.0).collect::<Vec<_>>(), vec![call(7, "all_gather_matmul")]);
        drop(inside);
        std::thread::sleep(Duration::from_millis(20));
        let Whereabouts::Outside { last, ago } = whereabouts(5001) else { panic!("{:?}", whereabouts(5001)) };
        assert_eq!(last, call(7, "all_gather_matmul"));
        assert!(ago >= Duration::from_millis(20) && ago < Duration::from_secs(5), "{ago:?}");
    }

    #[test]
    fn calls_in_flight_at_once_are_listed_oldest_first_and_leave_in_any_order() {
        let first = enter(5002, call(1, "all_gather_matmul"));
        let second = enter(5002, call(2, "matmul_reduce_scatter"));
        let listed = |w: Whereabouts| match w {
            Whereabouts::Inside(calls) => calls.iter().map(|c| c.0.site).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(listed(whereabouts(5002)), vec![1, 2]);
        drop(first);
        assert_eq!(listed(whereabouts(5002)), vec![2]);
        drop(second);
        assert!(matches!(whereabouts(5002), Whereabouts::Outside { last, .. } if last.site == 2));
    }

    #[test]
    fn the_description_says_which_devices_never_entered_which_left_and_which_are_busy() {
        let waiting = call(5, "all_gather_matmul");
        drop(enter(5011, call(4, "matmul_reduce_scatter")));
        drop(enter(5015, call(4, "matmul_reduce_scatter")));
        let _busy = enter(5012, CallIdentity { sequence: 2, ..call(9, "all_to_all_matmul") });
        let _joining = enter(5013, waiting);
        let text = describe_missing(&[5010, 5011, 5012, 5013, 5014, 5015, 5010], &waiting);
        for part in [
            "devices [5010, 5014] have not entered any commfuse call in this process; ",
            "devices [5011, 5015] have not entered any commfuse call since leaving one ",
            " ms ago (call site 4, kind matmul_reduce_scatter, run 3); ",
            "device 5012 is inside another commfuse call \
             (call site 9, kind all_to_all_matmul, run 3, its call 3 of that site in the run) since ",
            "device 5013 entered this call ",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        assert!(!text.contains("lax."), "{text}");
    }

    #[test]
    fn one_device_that_never_entered_is_named_alone() {
        let text = describe_missing(&[5020], &call(1, "all_gather_matmul"));
        assert_eq!(text, "device 5020 has not entered any commfuse call in this process");
    }

    #[test]
    fn a_device_in_several_calls_is_said_to_be_held_in_the_oldest() {
        let _first = enter(5021, call(2, "all_gather_matmul"));
        let _second = enter(5021, call(3, "all_gather_matmul"));
        let text = describe_missing(&[5021], &call(1, "all_gather_matmul"));
        assert!(text.starts_with("device 5021 is inside another commfuse call (call site 2, "), "{text}");
        assert!(text.ends_with(" ms ago, and in 1 later one(s)"), "{text}");
    }

    #[test]
    fn a_long_list_is_cut_short() {
        let _inside: Vec<Inside> = (5030..5040).map(|d| enter(d, call(d, "all_gather_matmul"))).collect();
        let devices: Vec<i64> = (5030..5040).collect();
        let text = describe_missing(&devices, &call(1, "all_gather_matmul"));
        assert_eq!(text.matches("is inside another commfuse call").count(), 8, "{text}");
        assert!(text.ends_with("; 2 more situations not described"), "{text}");
    }
}
