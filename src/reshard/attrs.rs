//! The attributes of a reshard call, as `python/commfuse/_reshard.py`
//! writes them for both backends' handlers, and the plan they describe.
#![forbid(unsafe_code)]

use super::{choose, plan, Layout, Method, Plan, Region};
use crate::error::{Error, Result};
use crate::xla::Frame;

/// The attribute `method`: how Python names the methods.
pub const DIRECT: i64 = 0;
pub const BROADCAST: i64 = 1;
/// The cost model's pick (`reshard::choose`) on the link's bandwidth and latency.
pub const AUTO: i64 = 2;

/// A reshard call's attributes, undecoded: also the key under which each
/// backend caches the plan they describe.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attrs {
    /// The union of the two meshes' devices: the plan's ranks.
    pub devices: Vec<i64>,
    pub shape: Vec<i64>,
    pub itemsize: i64,
    /// Per rank `2 * ndim` values, start then end, or all -1 for a rank without a tile.
    pub src: Vec<i64>,
    pub dst: Vec<i64>,
    pub method: i64,
    pub chunk_bytes: i64,
}

impl Attrs {
    pub fn decode(frame: &Frame<'_>) -> Result<Attrs> {
        let array = |name| frame.attr_i64_array(name).map(<[i64]>::to_vec);
        Ok(Attrs {
            devices: array("devices")?,
            shape: array("shape")?,
            itemsize: frame.attr_i64("itemsize")?,
            src: array("src")?,
            dst: array("dst")?,
            method: frame.attr_i64("method")?,
            chunk_bytes: frame.attr_i64("chunk_bytes")?,
        })
    }

    /// The rank of `device` in the union.
    pub fn rank_of(&self, device: i64) -> Result<usize> {
        self.devices.iter().position(|&d| d == device).ok_or_else(|| {
            Error::InvalidArgument(format!("reshard: device {device} is not among the devices {:?}", self.devices))
        })
    }

    /// Checks the attributes and plans the reshard they describe; `auto`
    /// decides on links of `link` (bytes per second, seconds per message).
    pub fn plan(&self, link: (f64, f64)) -> Result<(Layout, Method, Plan)> {
        let shape: Vec<usize> =
            self.shape
                .iter()
                .map(|&d| usize::try_from(d))
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| Error::InvalidArgument(format!("reshard: negative dim in shape {:?}", self.shape)))?;
        let itemsize =
            usize::try_from(self.itemsize).map_err(|_| Error::InvalidArgument("reshard: negative itemsize".into()))?;
        let devices = &self.devices;
        let ranks = devices.len();
        if (1..ranks).any(|i| devices[..i].contains(&devices[i])) {
            return Err(Error::InvalidArgument(format!("reshard: attribute `devices` repeats a device: {devices:?}")));
        }
        let src = tiles("src", &self.src, ranks, shape.len())?;
        let dst = tiles("dst", &self.dst, ranks, shape.len())?;
        let layout = Layout::new(shape, itemsize, src, dst)?;
        let chunk_bytes = usize::try_from(self.chunk_bytes)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| Error::InvalidArgument("reshard: chunk_bytes must be positive".into()))?;
        let (method, plan) = match self.method {
            DIRECT => (Method::Direct, plan(&layout, Method::Direct)),
            BROADCAST => {
                let method = Method::Broadcast { chunk_bytes };
                (method, plan(&layout, method))
            }
            AUTO => choose(&layout, chunk_bytes, link.0, link.1),
            other => return Err(Error::InvalidArgument(format!("reshard: unknown method {other}"))),
        };
        Ok((layout, method, plan))
    }
}

/// Tiles as Python writes them (see `Attrs::src`).
fn tiles(name: &str, flat: &[i64], ranks: usize, ndim: usize) -> Result<Vec<Option<Region>>> {
    let per = 2 * ndim;
    if flat.len() != ranks * per {
        return Err(Error::InvalidArgument(format!(
            "reshard: attribute `{name}` has {} values, expected {ranks} ranks x {per}",
            flat.len()
        )));
    }
    (0..ranks)
        .map(|r| {
            let t = &flat[r * per..(r + 1) * per];
            if ndim > 0 && t.iter().all(|&v| v == -1) {
                return Ok(None);
            }
            let dims = t.iter().map(|&v| usize::try_from(v)).collect::<std::result::Result<Vec<_>, _>>();
            let dims =
                dims.map_err(|_| Error::InvalidArgument(format!("reshard: `{name}` of rank {r} is negative")))?;
            Ok(Some(Region { start: dims[..ndim].to_vec(), end: dims[ndim..].to_vec() }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn any_attributes_are_planned_or_refused_naming_what_is_wrong() {
        let mut rng = StdRng::seed_from_u64(15);
        let mut planned = 0;
        for _ in 0..3000 {
            let values = |rng: &mut StdRng, right: usize| -> Vec<i64> {
                // Mostly as many as Python writes, sometimes not.
                let len = if rng.random_bool(0.9) { right } else { rng.random_range(0..9) };
                (0..len).map(|_| [-1, 0, 1, 2, 3, 4, 8, i64::MAX, i64::MIN][rng.random_range(0..9)]).collect()
            };
            let ranks = rng.random_range(0..4);
            let ndim = rng.random_range(0..3);
            let attrs = Attrs {
                devices: (0..ranks as i64).collect(),
                shape: values(&mut rng, ndim),
                itemsize: rng.random_range(-1..5),
                src: values(&mut rng, 2 * ndim * ranks),
                dst: values(&mut rng, 2 * ndim * ranks),
                method: rng.random_range(-1..4),
                chunk_bytes: rng.random_range(-1..64),
            };
            match attrs.plan((1e9, 1e-6)) {
                Ok(_) => planned += 1,
                Err(e) => assert!(matches!(e, Error::InvalidArgument(_)) && e.message().starts_with("reshard"), "{e}"),
            }
        }
        assert!(planned > 0, "some random attributes describe a reshard");
    }
}
