//! Groups and ranks from the mesh: which devices take part in one op, and
//! where this device stands among them.
#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// The devices of one op's group, in rank order, and this device's rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Group {
    pub devices: Vec<i64>,
    pub rank: usize,
}

impl Group {
    pub fn size(&self) -> usize {
        self.devices.len()
    }

    /// The group of `device` for an op over mesh axes `axes` (positions in
    /// `mesh_shape`, in the order the user named them). `mesh_devices` lists
    /// the mesh's device ids row-major. The group is every device that shares
    /// this device's coordinates on the other axes; the rank is the row-major
    /// index of its coordinates on `axes`, as `jax.lax.axis_index` counts.
    pub fn from_mesh(mesh_devices: &[i64], mesh_shape: &[i64], axes: &[i64], device: i64) -> Result<Group> {
        let shape: Vec<usize> = mesh_shape
            .iter()
            .map(|&d| usize::try_from(d).ok().filter(|&d| d > 0))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid(format!("mesh_shape must be positive sizes, got {mesh_shape:?}")))?;
        // Checked: a hostile frame's sizes may overflow the product.
        let needed = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if needed != Some(mesh_devices.len()) {
            let needed = needed.map_or("more than 2^64".to_string(), |n| n.to_string());
            return Err(invalid(format!(
                "mesh_devices has {} ids but mesh_shape {mesh_shape:?} needs {needed}",
                mesh_devices.len()
            )));
        }
        let axes: Vec<usize> = axes
            .iter()
            .map(|&a| usize::try_from(a).ok().filter(|&a| a < shape.len()))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid(format!("axes {axes:?} out of range for a mesh of rank {}", shape.len())))?;
        let mut unique = axes.clone();
        unique.sort();
        unique.dedup();
        if axes.is_empty() || unique.len() != axes.len() {
            return Err(invalid(format!("axes must name distinct mesh axes, got {axes:?}")));
        }
        let position = mesh_devices
            .iter()
            .position(|&d| d == device)
            .ok_or_else(|| invalid(format!("this device (id {device}) is not in the mesh {mesh_devices:?}")))?;
        let mine = unravel(position, &shape);

        // Walk the op's axes row-major with the other coordinates fixed.
        let group_shape: Vec<usize> = axes.iter().map(|&a| shape[a]).collect();
        let size: usize = group_shape.iter().product();
        let mut devices = Vec::with_capacity(size);
        let mut rank = 0;
        for index in 0..size {
            let along = unravel(index, &group_shape);
            let mut coords = mine.clone();
            for (&axis, &c) in axes.iter().zip(&along) {
                coords[axis] = c;
            }
            if coords == mine {
                rank = index;
            }
            devices.push(mesh_devices[ravel(&coords, &shape)]);
        }
        Ok(Group { devices, rank })
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

fn unravel(mut index: usize, shape: &[usize]) -> Vec<usize> {
    let mut coords = vec![0; shape.len()];
    for (c, &d) in coords.iter_mut().zip(shape).rev() {
        *c = index % d;
        index /= d;
    }
    coords
}

fn ravel(coords: &[usize], shape: &[usize]) -> usize {
    coords.iter().zip(shape).fold(0, |acc, (&c, &d)| acc * d + c)
}

#[cfg(test)]
mod tests {
    use super::*;

    // A 2x4 mesh ("dp", "tp") with shuffled device ids, as a mesh may have.
    const IDS: [i64; 8] = [5, 1, 7, 3, 0, 4, 2, 6];
    const SHAPE: [i64; 2] = [2, 4];

    #[test]
    fn groups_along_each_axis_of_a_2x4_mesh() {
        // Device 4 sits at (dp=1, tp=1).
        let tp = Group::from_mesh(&IDS, &SHAPE, &[1], 4).unwrap();
        assert_eq!(tp, Group { devices: vec![0, 4, 2, 6], rank: 1 });
        let dp = Group::from_mesh(&IDS, &SHAPE, &[0], 4).unwrap();
        assert_eq!(dp, Group { devices: vec![1, 4], rank: 1 });
        // Both axes, in either order: rank is row-major over the named order.
        let both = Group::from_mesh(&IDS, &SHAPE, &[0, 1], 4).unwrap();
        assert_eq!(both, Group { devices: IDS.to_vec(), rank: 5 });
        let swapped = Group::from_mesh(&IDS, &SHAPE, &[1, 0], 4).unwrap();
        assert_eq!(swapped, Group { devices: vec![5, 0, 1, 4, 7, 2, 3, 6], rank: 3 });
    }

    #[test]
    fn every_device_of_a_group_agrees_on_it() {
        for axis in 0..2 {
            for &d in &IDS {
                let g = Group::from_mesh(&IDS, &SHAPE, &[axis], d).unwrap();
                assert_eq!(g.devices[g.rank], d);
                for &peer in &g.devices {
                    let other = Group::from_mesh(&IDS, &SHAPE, &[axis], peer).unwrap();
                    assert_eq!(other.devices, g.devices);
                }
            }
        }
    }

    #[test]
    fn a_mesh_shape_whose_product_overflows_is_rejected() {
        let e = Group::from_mesh(&[0, 1], &[1 << 32, 1 << 32, 4], &[0], 0).unwrap_err();
        assert!(e.to_string().contains("needs more than 2^64"), "{e}");
    }

    #[test]
    fn bad_meshes_are_rejected_with_the_reason() {
        let e = Group::from_mesh(&IDS, &SHAPE, &[1], 99).unwrap_err();
        assert!(e.message().contains("id 99"), "{e}");
        let e = Group::from_mesh(&IDS, &[3, 4], &[1], 4).unwrap_err();
        assert!(e.message().contains("needs 12"), "{e}");
        let e = Group::from_mesh(&IDS, &SHAPE, &[2], 4).unwrap_err();
        assert!(e.message().contains("out of range"), "{e}");
        let e = Group::from_mesh(&IDS, &SHAPE, &[1, 1], 4).unwrap_err();
        assert!(e.message().contains("distinct"), "{e}");
    }
}
