//! The tile/wave model of a GPU GEMM: why a ring's per-peer pieces run
//! slower than one GEMM of the same work.
//!
//! A GEMM's output is cut into tiles; each streaming multiprocessor (SM)
//! computes one tile at a time, so the tiles run in waves of `sms`, and the
//! last wave leaves SMs idle when the tile count is not a multiple of `sms`.
//! cuBLAS picks the tile per shape: large tiles reuse operands best, small
//! ones fill the last wave better. The model takes, over the tiles a GPU
//! library offers, the best of `tile efficiency × waves' occupancy`.
//!
//! The tiles' efficiencies were fitted to the per-peer pieces measured on an
//! H200 and an H100 (GPU.md, "GEMM facts"): over 32 measured (shape, N)
//! points of bf16 GEMMs cut in N = 2 to 16 row pieces, the model's ratio of
//! pieces to one GEMM is within 0.026 on average and 0.10 at worst (the test
//! below holds the points).
#![forbid(unsafe_code)]

/// One output tile a GEMM library offers, and the fraction of the full-tile
/// rate a kernel of it reaches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tile {
    pub rows: usize,
    pub cols: usize,
    pub efficiency: f64,
}

/// The bf16 tiles of cuBLAS on Hopper (sm_90) the fit uses.
pub const HOPPER_TILES: [Tile; 5] = [
    Tile { rows: 128, cols: 256, efficiency: 1.0 },
    Tile { rows: 256, cols: 128, efficiency: 1.0 },
    Tile { rows: 128, cols: 128, efficiency: 0.92 },
    Tile { rows: 64, cols: 256, efficiency: 0.75 },
    Tile { rows: 64, cols: 128, efficiency: 0.8 },
];

/// A GPU's SMs and its library's tiles.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waves {
    pub sms: usize,
    pub tiles: &'static [Tile],
}

impl Waves {
    /// An H100 SXM or H200: 132 SMs, Hopper's tiles.
    pub const HOPPER_132: Waves = Waves { sms: 132, tiles: &HOPPER_TILES };
    /// An H100 PCIe: 114 SMs.
    pub const HOPPER_114: Waves = Waves { sms: 114, tiles: &HOPPER_TILES };

    /// The fraction of the full-tile, full-wave rate a GEMM of an `m × n`
    /// output reaches: the best tile's efficiency times the share of its
    /// waves' SM slots that hold a tile.
    pub fn efficiency(&self, m: usize, n: usize) -> f64 {
        if m == 0 || n == 0 || self.sms == 0 {
            return 1.0;
        }
        self.tiles
            .iter()
            .map(|t| {
                let tiles = m.div_ceil(t.rows) * n.div_ceil(t.cols);
                let slots = tiles.div_ceil(self.sms) * self.sms;
                // Tiles larger than the output's edges compute padding.
                let useful = (m * n) as f64 / (tiles * t.rows * t.cols) as f64;
                t.efficiency * useful * tiles as f64 / slots as f64
            })
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    /// Pieces against one GEMM, `one / (parts × piece)`, each GEMM timed by
    /// the H100 preset's `Compute::gemm_s` (rows `m`, contraction `k`,
    /// columns `n`), as the cost model times a plan's GEMMs.
    fn pieces_ratio((m, k, n): (usize, usize, usize), parts: usize) -> f64 {
        let compute = crate::sim::Machine::h100_nvlink().compute;
        let time = |rows: usize| compute.gemm_s(rows, k, n, DType::BF16, DType::BF16, false);
        time(m) / (parts as f64 * time(m / parts))
    }

    /// The measured per-peer pieces (bf16, rows cut in N pieces, back to
    /// back on one stream) against one GEMM: an H200 on 2026-11-26 and an
    /// H100 on 2026-11-25 (`scripts/gpu_contention.py`, GPU.md).
    const MEASURED: [((usize, usize, usize), [f64; 4]); 8] = [
        ((8192, 8192, 3584), [0.916, 0.857, 0.833, 0.783]),
        ((2048, 8192, 3584), [0.969, 0.912, 0.817, 0.460]),
        ((16384, 8192, 3584), [0.964, 0.912, 0.853, 0.836]),
        ((8192, 16384, 6656), [0.956, 0.949, 0.799, 0.786]),
        ((8192, 8192, 8192), [1.02, 1.01, 0.993, 0.973]),
        ((8192, 8192, 3584), [0.95, 0.88, 0.86, 0.79]),
        ((4096, 8192, 3584), [1.0, 0.97, 0.92, 0.73]),
        ((8192, 8192, 8192), [0.97, 0.96, 0.98, 0.95]),
    ];

    #[test]
    fn the_model_follows_the_measured_pieces() {
        let mut errors = Vec::new();
        for (shape, measured) in MEASURED {
            for (parts, want) in [2, 4, 8, 16].into_iter().zip(measured) {
                let got = pieces_ratio(shape, parts);
                assert!((got - want).abs() <= 0.10, "{shape:?} in {parts}: model {got:.3}, measured {want}");
                errors.push((got - want).abs());
            }
        }
        let mean = errors.iter().sum::<f64>() / errors.len() as f64;
        assert!(mean <= 0.03, "mean error {mean:.3}");
    }

    #[test]
    fn a_full_wave_of_large_tiles_is_whole_and_a_ragged_one_is_not() {
        let w = Waves::HOPPER_132;
        // 132 tiles of 128 × 256 fill the SMs exactly once.
        assert!((w.efficiency(128 * 12, 256 * 11) - 1.0).abs() < 1e-12);
        // A Llama-70B MLP piece at TP 8: 1024 × 3584 is 112 tiles of 128 ×
        // 256 on 132 SMs; no smaller tile does better than 0.85.
        let piece = w.efficiency(1024, 3584);
        assert!((0.8..0.86).contains(&piece), "{piece}");
        assert!(w.efficiency(8192, 3584) > 0.95);
        assert_eq!(w.efficiency(0, 10), 1.0);
        // Rows and columns are not interchangeable: 64-row tiles exist, 64-column ones do not.
        assert!(w.efficiency(64, 132 * 256) > w.efficiency(132 * 256, 64) + 0.2);
    }
}
