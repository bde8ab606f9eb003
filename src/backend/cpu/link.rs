//! The link model: throttles the in-process transfers of the CPU backend to a
//! given bandwidth and latency, so that the communication-bound regime shows
//! in wall-clock time.
//!
//! Nothing spins. The sender stamps each message with the time it will have
//! arrived under the model, from a process-wide table of when each port (or
//! link) is busy until; the receiver sleeps on its condvar until then. The
//! table is shared by every op of the process, so concurrent ops contend as
//! transfers on one machine would.
//!
//! - `switch` (default): each device has one outgoing and one incoming port of
//!   the full bandwidth (an NVSwitch). A transfer needs `bytes / bandwidth` of
//!   the sender's out port and of the receiver's in port; transfers sharing a
//!   port share it, so two of them take `2 B / bandwidth`. Ports fill their
//!   free time (see `PortTable`), so concurrent senders never leave one idle.
//! - `ring`: one link per neighbour pair and direction (ring order of the op's
//!   group). Sending to both neighbours at once uses two links. A transfer to
//!   a non-neighbour is routed through the ring the shorter way (forward on a
//!   tie), store-and-forward: each hop holds its link and pays the latency.
//!
//! Every message pays the latency once per hop, after its bytes have left.
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable holding the model, e.g.
/// `gbytes_per_s=0.5,latency_us=20,topology=switch`.
pub const LINK_VAR: &str = "COMMFUSE_CPU_LINK";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    Switch,
    Ring,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Bytes per second of one port or link; infinite when only a latency is given.
    pub bytes_per_s: f64,
    pub latency: Duration,
    pub topology: Topology,
}

impl LinkModel {
    /// Parses `key=value` pairs separated by commas. `None` for an empty text
    /// (full speed). Keys: `gbytes_per_s` (> 0), `latency_us` (>= 0),
    /// `topology` (`switch` or `ring`); at least one of the first two.
    pub fn parse(text: &str) -> Result<Option<LinkModel>> {
        let bad = |field: &str, why: String| {
            Error::InvalidArgument(format!(
                "{LINK_VAR}={text:?}: bad field `{field}`: {why} (expected e.g. \
                 gbytes_per_s=0.5,latency_us=20,topology=switch)"
            ))
        };
        let mut bandwidth = None;
        let mut latency = None;
        let mut topology = None;
        let mut any = false;
        for field in text.split(',').map(str::trim).filter(|f| !f.is_empty()) {
            any = true;
            let Some((key, value)) = field.split_once('=') else {
                return Err(bad(field, "not of the form key=value".into()));
            };
            let (key, value) = (key.trim(), value.trim());
            let number = |min_exclusive: bool| -> Result<f64> {
                let v: f64 = value.parse().map_err(|_| bad(field, format!("{value:?} is not a number")))?;
                let ok = v.is_finite() && if min_exclusive { v > 0.0 } else { v >= 0.0 };
                if !ok {
                    let want = if min_exclusive { "a positive" } else { "a non-negative" };
                    return Err(bad(field, format!("must be {want} finite number")));
                }
                Ok(v)
            };
            let repeated = || bad(field, format!("`{key}` given twice"));
            match key {
                "gbytes_per_s" => {
                    if bandwidth.replace(number(true)? * 1e9).is_some() {
                        return Err(repeated());
                    }
                }
                "latency_us" => {
                    if latency.replace(Duration::from_secs_f64(number(false)? * 1e-6)).is_some() {
                        return Err(repeated());
                    }
                }
                "topology" => {
                    let t = match value {
                        "switch" => Topology::Switch,
                        "ring" => Topology::Ring,
                        _ => return Err(bad(field, format!("unknown topology {value:?}; expected switch or ring"))),
                    };
                    if topology.replace(t).is_some() {
                        return Err(repeated());
                    }
                }
                _ => {
                    return Err(bad(field, format!("unknown key {key:?}; expected gbytes_per_s, latency_us, topology")))
                }
            }
        }
        if !any {
            return Ok(None);
        }
        if bandwidth.is_none() && latency.is_none() {
            return Err(bad("topology", "give gbytes_per_s and/or latency_us as well".into()));
        }
        Ok(Some(LinkModel {
            bytes_per_s: bandwidth.unwrap_or(f64::INFINITY),
            latency: latency.unwrap_or(Duration::ZERO),
            topology: topology.unwrap_or(Topology::Switch),
        }))
    }

    /// The model in the environment now (each call reads it: it may change
    /// between runs of one compiled program).
    pub fn from_env() -> Result<Option<LinkModel>> {
        match std::env::var(LINK_VAR) {
            Ok(text) => LinkModel::parse(&text),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::InvalidArgument(format!("{LINK_VAR} is not valid UTF-8")))
            }
        }
    }

    fn transfer_time(&self, bytes: usize) -> Duration {
        if self.bytes_per_s.is_infinite() {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(bytes as f64 / self.bytes_per_s)
        }
    }

    /// When a message of `bytes` posted at `now` from rank `from` to rank `to`
    /// of `group` (device ids in ring order) has arrived; books the ports or links.
    pub fn arrival(&self, now: Instant, group: &[i64], from: usize, to: usize, bytes: usize) -> Instant {
        let duration = self.transfer_time(bytes);
        let mut table = crate::sync::lock(ports());
        match self.topology {
            Topology::Switch => {
                // The bytes leave through the out port, and drain through the
                // in port no earlier than they started to leave.
                let (left_from, left) = table.fill(Port::Out(group[from]), now, duration);
                let (_, drained) = table.fill(Port::In(group[to]), left_from, duration);
                left.max(drained) + self.latency
            }
            Topology::Ring => {
                let n = group.len();
                let forward = (to + n - from) % n;
                let step = if forward <= n - forward { 1 } else { n - 1 };
                let (mut at, mut ready) = (from, now);
                while at != to {
                    let next = (at + step) % n;
                    ready = table.fill(Port::Link(group[at], group[next]), ready, duration).1 + self.latency;
                    at = next;
                }
                ready
            }
        }
    }
}

/// Per port, the times it is busy: sorted, disjoint intervals. A transfer
/// uses the port's free time from when it can start until it has had its
/// duration, filling gaps (a port shared by two transfers at once serves
/// both, each at a share of the bandwidth, and is never idle while one waits).
#[derive(Default)]
struct PortTable {
    busy: HashMap<Port, Vec<(Instant, Instant)>>,
}

impl PortTable {
    /// Books `duration` of `port`'s free time from `from` on; returns when the
    /// first part starts and when the last part ends.
    fn fill(&mut self, port: Port, from: Instant, duration: Duration) -> (Instant, Instant) {
        if duration.is_zero() {
            return (from, from);
        }
        let list = self.busy.entry(port).or_default();
        // Bookings ended long before this one starts cannot matter any more:
        // later bookings start at their step's readiness, which is at most
        // the comm thread's lateness (milliseconds) before the current time.
        let horizon = from.checked_sub(Duration::from_secs(1)).unwrap_or(from);
        list.retain(|&(_, end)| end > horizon);
        let mut left = duration;
        let mut cursor = from;
        let mut first = None;
        let mut parts = vec![];
        for &(start, end) in list.iter() {
            if end <= cursor {
                continue;
            }
            if start > cursor {
                let take = (start - cursor).min(left);
                first.get_or_insert(cursor);
                parts.push((cursor, cursor + take));
                left -= take;
                if left.is_zero() {
                    break;
                }
            }
            cursor = cursor.max(end);
        }
        if !left.is_zero() {
            first.get_or_insert(cursor);
            parts.push((cursor, cursor + left));
        }
        let end = parts.last().expect("a part").1;
        list.extend(parts);
        list.sort();
        // Merge touching intervals so the list stays short.
        let mut merged: Vec<(Instant, Instant)> = Vec::with_capacity(list.len());
        for &(s, e) in list.iter() {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        *list = merged;
        (first.expect("a part"), end)
    }
}

/// What a transfer holds while its bytes move: a device's outgoing or
/// incoming switch port, or the ring link between two devices (one direction).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Port {
    Out(i64),
    In(i64),
    Link(i64, i64),
}

fn ports() -> &'static Mutex<PortTable> {
    static PORTS: OnceLock<Mutex<PortTable>> = OnceLock::new();
    PORTS.get_or_init(Default::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_form() {
        let m = LinkModel::parse("gbytes_per_s=0.5,latency_us=20,topology=switch").unwrap().unwrap();
        assert_eq!(m.bytes_per_s, 0.5e9);
        assert_eq!(m.latency, Duration::from_micros(20));
        assert_eq!(m.topology, Topology::Switch);
        let m = LinkModel::parse(" topology=ring , gbytes_per_s=2 ").unwrap().unwrap();
        assert_eq!((m.bytes_per_s, m.latency, m.topology), (2e9, Duration::ZERO, Topology::Ring));
        let m = LinkModel::parse("latency_us=5").unwrap().unwrap();
        assert!(m.bytes_per_s.is_infinite());
        assert_eq!(LinkModel::parse("").unwrap(), None);
        assert_eq!(LinkModel::parse(" , ").unwrap(), None);
    }

    #[test]
    fn malformed_values_name_the_variable_and_the_field() {
        for (text, field) in [
            ("gbytes_per_s=fast", "gbytes_per_s=fast"),
            ("gbytes_per_s=0", "gbytes_per_s=0"),
            ("gbytes_per_s=-1", "gbytes_per_s=-1"),
            ("gbytes_per_s=inf", "gbytes_per_s=inf"),
            ("gbytes_per_s=1,latency_us=-3", "latency_us=-3"),
            ("gbytes_per_s=1,topology=torus", "topology=torus"),
            ("gbytes_per_s=1,bandwidth=3", "bandwidth=3"),
            ("gbytes_per_s", "gbytes_per_s"),
            ("gbytes_per_s=1,gbytes_per_s=2", "gbytes_per_s=2"),
            ("topology=ring", "topology"),
        ] {
            let e = LinkModel::parse(text).unwrap_err();
            let Error::InvalidArgument(message) = &e else { panic!("{e:?}") };
            assert!(message.contains(LINK_VAR), "{message}");
            assert!(message.contains(&format!("bad field `{field}`")), "{text}: {message}");
        }
    }

    fn model(topology: Topology) -> LinkModel {
        LinkModel { bytes_per_s: 1e9, latency: Duration::from_micros(10), topology }
    }

    // Distinct device ids per test: the port table is shared by the process.
    #[test]
    fn switch_ports_serialise_transfers_that_share_them() {
        let m = model(Topology::Switch);
        let group = [1000, 1001, 1002, 1003];
        let t0 = Instant::now() + Duration::from_secs(1);
        let ms = Duration::from_millis(1);
        // 1 MB takes 1 ms plus the latency.
        assert_eq!(m.arrival(t0, &group, 0, 1, 1_000_000), t0 + ms + m.latency);
        // Another into rank 1 waits for its in port; one from 2 to 3 does not.
        assert_eq!(m.arrival(t0, &group, 2, 1, 1_000_000), t0 + 2 * ms + m.latency);
        // 2's out port is busy for the first 1 ms.
        assert_eq!(m.arrival(t0, &group, 2, 3, 1_000_000), t0 + 2 * ms + m.latency);
        assert_eq!(m.arrival(t0, &group, 2, 0, 1_000_000), t0 + 3 * ms + m.latency);
        assert_eq!(m.arrival(t0 + 10 * ms, &group, 3, 0, 1_000), t0 + 10 * ms + ms / 1000 + m.latency);
    }

    #[test]
    fn every_rank_sending_to_both_neighbours_takes_two_block_times_whatever_the_booking_order() {
        let m = LinkModel { latency: Duration::ZERO, ..model(Topology::Switch) };
        let group = [1100, 1101, 1102, 1103];
        let t0 = Instant::now() + Duration::from_secs(1);
        let last = (0..4)
            .flat_map(|r| [(r, (r + 1) % 4), (r, (r + 3) % 4)])
            .map(|(from, to)| m.arrival(t0, &group, from, to, 1_000_000))
            .max()
            .unwrap();
        assert_eq!(last, t0 + Duration::from_millis(2));
    }

    #[test]
    fn ring_links_are_per_neighbour_and_direction_and_routes_go_the_short_way() {
        let m = model(Topology::Ring);
        let group = [2000, 2001, 2002, 2003, 2004];
        let t0 = Instant::now() + Duration::from_secs(1);
        let ms = Duration::from_millis(1);
        let one = ms + m.latency;
        // To both neighbours at once: two links, no waiting.
        assert_eq!(m.arrival(t0, &group, 0, 1, 1_000_000), t0 + one);
        assert_eq!(m.arrival(t0, &group, 0, 4, 1_000_000), t0 + one);
        // The reverse direction is its own link.
        assert_eq!(m.arrival(t0, &group, 1, 0, 1_000_000), t0 + one);
        // Two hops forward (0 -> 1 is busy until t0 + 1 ms): 1 ms wait, then 2 hops.
        assert_eq!(m.arrival(t0, &group, 0, 2, 1_000_000), t0 + ms + one + one);
        // 3 -> 0 is 2 hops forward (3 -> 4 -> 0), shorter than 3 backward.
        assert_eq!(m.arrival(t0 + 100 * ms, &group, 3, 0, 1_000_000), t0 + 100 * ms + 2 * one);
    }
}
