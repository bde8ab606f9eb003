//! A cost model: times a [`Plan`](crate::plan::Plan) on a machine description.
//!
//! Pure code. [`engine`] is a discrete-event simulation of all N ranks' plans
//! together: per device one compute lane and one comm lane, each running its
//! steps in plan order once their dependencies have finished; GEMMs and sums
//! take the time the machine's roofline gives their shape; a send occupies the
//! ports (switch) or links (ring) on its way for `bytes / bandwidth`, shared
//! equally with the transfers using them at the same time, then pays the
//! latency; a receive ends when its message has arrived. [`model`] derives the
//! per-step costs from a [`Problem`](crate::problem::Problem), predicts every
//! schedule and picks the fastest ([`choose`]); [`explain`] renders that as JSON
//! for `commfuse.explain`.
#![forbid(unsafe_code)]

pub mod engine;
pub mod explain;
pub mod gemm_waves;
pub mod model;
pub mod step;
#[cfg(test)]
mod tests;

pub use engine::{simulate, Timeline};
pub use model::{auto_pick, auto_schedule, candidates, choose, predict, whole_gemm_s, Choice, Mode};

use crate::dtype::DType;
use crate::error::{Error, Result};
use gemm_waves::Waves;

/// How devices are connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    /// Every device has one outgoing and one incoming port of the full
    /// bandwidth (an NVSwitch, or a PCIe switch); transfers sharing a port share it.
    Switch,
    /// One link per neighbour pair and direction (ring order of the group);
    /// other transfers are routed the short way, store-and-forward.
    Ring,
}

/// Link bandwidth (bytes per second per port or link, per direction) and the
/// latency each message pays per hop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub bytes_per_s: f64,
    pub latency_s: f64,
    pub topology: Topology,
}

/// The GEMM rate as a function of shape: a roofline, `time = overhead +
/// max(flops / (peak * efficiency * size_efficiency), bytes / memory bandwidth)`.
/// On a GPU (`waves`), `size_efficiency` is the tile/wave model's
/// ([`gemm_waves`]: the last wave of tiles leaves SMs idle); elsewhere it is
/// `d / (d + half_dim)` for `d` the smallest of m, k, n (thin GEMMs fill
/// fewer tiles). Sums and copies are memory bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compute {
    /// Peak flop/s for 16-bit inputs (bf16, f16), f32 inputs, and f64 inputs.
    pub peak_16: f64,
    pub peak_32: f64,
    pub peak_64: f64,
    /// The fraction of the peak large GEMMs achieve.
    pub efficiency: f64,
    /// Bytes per second of device memory.
    pub memory_bytes_per_s: f64,
    /// Bytes per second at which memory mapped afresh is first written
    /// (infinite: none is, as GPU runtimes pool their allocations). On CPU
    /// devices XLA's runtime allocates an execution's temporaries anew
    /// each time, and the host maps a large allocation in again each time
    /// (`cpu_here`: measured by the planner, the `touch_gbytes_per_s` key).
    pub touch_bytes_per_s: f64,
    /// The smallest dim at which a GEMM reaches half of `efficiency` (0: none).
    pub half_dim: f64,
    /// Fixed cost of each GEMM or sum (a kernel launch, a thread wake-up).
    pub overhead_s: f64,
    /// A GPU's SMs and tiles: GEMMs pay for their last wave (`None`: `half_dim`).
    pub waves: Option<Waves>,
}

impl Compute {
    pub fn peak(&self, dtype: DType) -> f64 {
        match dtype {
            // No machine here lists an fp8 peak: the 16-bit one is a lower bound.
            DType::BF16 | DType::F16 | DType::F8E4M3FN | DType::F8E5M2 => self.peak_16,
            DType::F32 => self.peak_32,
            DType::F64 => self.peak_64,
        }
    }

    /// Seconds for `dst (+)= [m, k] @ [k, n]`, inputs of `input` and results of `acc`.
    pub fn gemm_s(&self, m: usize, k: usize, n: usize, input: DType, acc: DType, accumulate: bool) -> f64 {
        let (mf, kf, nf) = (m as f64, k as f64, n as f64);
        let flops = 2.0 * mf * kf * nf;
        if flops == 0.0 {
            return self.overhead_s;
        }
        let d = mf.min(kf).min(nf);
        let size_efficiency = match self.waves {
            Some(w) => w.efficiency(m, n),
            None if self.half_dim > 0.0 => d / (d + self.half_dim),
            None => 1.0,
        };
        let rate = self.peak(input) * self.efficiency * size_efficiency;
        let reads = if accumulate { 2.0 } else { 1.0 };
        let bytes = (mf * kf + kf * nf) * input.size() as f64 + mf * nf * acc.size() as f64 * reads;
        self.overhead_s + (flops / rate).max(bytes / self.memory_bytes_per_s)
    }

    /// Seconds for a sum of `terms` buffers of `elements` into one (a copy for one term).
    pub fn sum_s(&self, elements: usize, terms: usize, acc: DType) -> f64 {
        let bytes = elements as f64 * acc.size() as f64 * (terms as f64 + 1.0);
        self.overhead_s + bytes / self.memory_bytes_per_s
    }
}

/// Several nodes of `devices_per_node` devices each: inside a node the
/// devices talk over `Machine::link`, between nodes over `link` (each
/// device's own share of the network, per direction).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    pub devices_per_node: usize,
    pub link: Link,
}

impl Network {
    /// InfiniBand NDR with one adapter per device: 400 Gb/s = 50 GB/s per
    /// direction (a ConnectX-7 port, NVIDIA's datasheet); ~10 us per message
    /// (an estimate: NCCL's inter-node latency over IB, proxy thread and
    /// switch hops included, sits between a few us and tens of us).
    pub const NDR_PER_DEVICE: Link = Link { bytes_per_s: 50e9, latency_s: 10e-6, topology: Topology::Switch };
}

/// A machine: N identical devices, their GEMM rate, and their links.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    pub name: String,
    pub compute: Compute,
    pub link: Link,
    /// `Some(p)`: the compute work (GEMMs and sums, on any lane) of all
    /// devices shares `p` processors, as host threads share a CPU's cores;
    /// `None`: each device computes on its own (a GPU per device).
    pub shared_processors: Option<f64>,
    /// The network between nodes (`None`: one node, every device on `link`).
    pub network: Option<Network>,
}

/// The preset names `Machine::preset` knows.
pub const PRESETS: [&str; 5] = ["cpu_here", "h100_nvlink", "h200_nvlink", "h100_pcie", "h100_cluster"];

impl Machine {
    /// H100 SXM5 80GB on NVLink 4 through NVSwitch (a DGX/HGX H100).
    /// - Dense tensor-core peaks from the NVIDIA H100 datasheet (SXM column):
    ///   bf16/fp16 989.4 TFLOP/s (1979 "with sparsity"), TF32 494.7 (used for
    ///   f32, as cuBLAS does under JAX's default precision), FP64 tensor 66.9.
    /// - 78% of peak on large GEMMs whose tiles fill whole waves: cuBLAS bf16
    ///   8192x8192x3584 measured at 788 TFLOP/s on an H100 (2026-11-25) and
    ///   700-800 on an H200 (2026-11-26); smaller GEMMs and per-peer pieces
    ///   lose their last wave (`gemm_waves`, fitted to the pieces measured on
    ///   both, GPU.md).
    /// - HBM3 3.35 TB/s (datasheet).
    /// - NVLink 4: 18 links x 50 GB/s = 900 GB/s bidirectional per GPU, i.e.
    ///   450 GB/s per direction, all through the NVSwitch: switch topology.
    ///   NCCL reaches ~370-400 GB/s bus bandwidth; we take 450 per the brief
    ///   of ideal-but-usable P2P over copy engines.
    /// - Latency ~8 us per message (NCCL P2P launch plus hop; an estimate),
    ///   and 2 us per kernel (launch and tail: the fit of the per-peer pieces).
    /// - Copy-engine transfers leave a GEMM its throughput (1.07-1.09 of it,
    ///   noise, beside unpaced copies at 1.5 TB/s on an H200 on 2026-11-26;
    ///   an H100 kept 0.83 unpaced, 1.0 at link rates), so transfers take
    ///   nothing from the GEMMs here; NCCL's kernels took 5-18% (GPU.md).
    pub fn h100_nvlink() -> Machine {
        Machine {
            name: "h100_nvlink".into(),
            compute: Compute {
                peak_16: 989.4e12,
                peak_32: 494.7e12,
                peak_64: 66.9e12,
                efficiency: 0.78,
                memory_bytes_per_s: 3.35e12,
                touch_bytes_per_s: f64::INFINITY,
                half_dim: 0.0,
                overhead_s: 2e-6,
                waves: Some(Waves::HOPPER_132),
            },
            link: Link { bytes_per_s: 450e9, latency_s: 8e-6, topology: Topology::Switch },
            shared_processors: None,
            network: None,
        }
    }

    /// H200 SXM 141GB: the H100's compute (NVIDIA H200 datasheet: bf16 989
    /// TFLOP/s dense, TF32 494.7, FP64 tensor 66.9), HBM3e at 4.8 TB/s, the
    /// same NVLink 4 (900 GB/s bidirectional, 450 per direction) and NVSwitch.
    pub fn h200_nvlink() -> Machine {
        let mut m = Machine::h100_nvlink();
        m.name = "h200_nvlink".into();
        m.compute.memory_bytes_per_s = 4.8e12;
        m
    }

    /// DGX H100 nodes (`h100_nvlink`: 8 H100 SXM5 on NVLink 4 through
    /// NVSwitch) joined by InfiniBand NDR. A DGX H100 has one single-port
    /// ConnectX-7 (400 Gb/s NDR) per GPU for the compute fabric (NVIDIA DGX
    /// H100 user guide): 50 GB/s per GPU and direction across nodes
    /// ([`Network::NDR_PER_DEVICE`]), a ninth of NVLink's 450.
    pub fn h100_cluster() -> Machine {
        let mut m = Machine::h100_nvlink();
        m.name = "h100_cluster".into();
        m.network = Some(Network { devices_per_node: 8, link: Network::NDR_PER_DEVICE });
        m
    }

    /// The machine with every transfer on the network: what a group of
    /// devices spanning nodes sees (its slowest hop). `None` on a machine
    /// without a network.
    pub fn across_nodes(&self) -> Option<Machine> {
        let network = self.network?;
        Some(Machine { link: network.link, ..self.clone() })
    }

    /// H100 PCIe 80GB in a host without NVLink bridges: transfers cross PCIe.
    /// - NVIDIA H100 datasheet (PCIe column): bf16 756 TFLOP/s dense (1513
    ///   with sparsity), TF32 378, FP64 tensor 51.2; HBM2e 2.0 TB/s.
    /// - PCIe Gen5 x16: 32 GT/s x 16 lanes ~ 64 GB/s per direction (128 GB/s
    ///   bidirectional, PCI-SIG Gen5 spec; ~50 GB/s is measured in practice).
    ///   Each GPU has its own x16 link into the PCIe switch / root complex:
    ///   switch topology with 64 GB/s ports.
    /// - Latency ~15 us per message (PCIe P2P through the root complex; an estimate).
    /// - 114 SMs (the PCIe part's), GEMMs as on the SXM part (`h100_nvlink`).
    pub fn h100_pcie() -> Machine {
        Machine {
            name: "h100_pcie".into(),
            compute: Compute {
                peak_16: 756e12,
                peak_32: 378e12,
                peak_64: 51.2e12,
                efficiency: 0.78,
                memory_bytes_per_s: 2.0e12,
                touch_bytes_per_s: f64::INFINITY,
                half_dim: 0.0,
                overhead_s: 2e-6,
                waves: Some(Waves::HOPPER_114),
            },
            link: Link { bytes_per_s: 64e9, latency_s: 15e-6, topology: Topology::Switch },
            shared_processors: None,
            network: None,
        }
    }

    /// This host's CPU backend: each device is a host thread running a
    /// single-threaded GEMM (`gemm` with `Parallelism::None`), all sharing
    /// `cores` cores. `gemm_gflops` is a measured single-thread GEMM rate
    /// (calibration); without one, 40 GFLOP/s (an AVX-512 core, f32) is
    /// assumed. In-process transfers are memcpys: ~10 GB/s, ~10 us per
    /// message (a condvar wake-up); set a link model to override.
    pub fn cpu_here(gemm_gflops: Option<f64>, cores: usize) -> Machine {
        let rate = gemm_gflops.filter(|g| g.is_finite() && *g > 0.0).unwrap_or(40.0) * 1e9;
        Machine {
            name: "cpu_here".into(),
            compute: Compute {
                peak_16: rate,
                peak_32: rate,
                peak_64: rate / 2.0,
                // A measured rate is what is achieved.
                efficiency: 1.0,
                memory_bytes_per_s: 10e9,
                // Unknown until measured (`touch_gbytes_per_s`).
                touch_bytes_per_s: f64::INFINITY,
                half_dim: 4.0,
                overhead_s: 5e-6,
                waves: None,
            },
            link: Link { bytes_per_s: 10e9, latency_s: 10e-6, topology: Topology::Switch },
            shared_processors: Some(cores.max(1) as f64),
            network: None,
        }
    }

    /// A preset by name.
    pub fn preset(name: &str, gemm_gflops: Option<f64>, cores: usize) -> Option<Machine> {
        let mut m = match name {
            "cpu_here" => return Some(Machine::cpu_here(gemm_gflops, cores)),
            "h100_nvlink" => Machine::h100_nvlink(),
            "h200_nvlink" => Machine::h200_nvlink(),
            "h100_pcie" => Machine::h100_pcie(),
            "h100_cluster" => Machine::h100_cluster(),
            _ => return None,
        };
        if let Some(g) = gemm_gflops.filter(|g| g.is_finite() && *g > 0.0) {
            // A measured rate replaces the achievable rate of every dtype's peak.
            let scale = g * 1e9 / (m.compute.peak_16 * m.compute.efficiency);
            m.compute.peak_16 *= scale;
            m.compute.peak_32 *= scale;
            m.compute.peak_64 *= scale;
        }
        Some(m)
    }

    /// `name` or `name:key=value,...` with keys `gbytes_per_s`, `latency_us`,
    /// `topology` (switch|ring), `gemm_gflops`, `mem_gbytes_per_s`,
    /// `touch_gbytes_per_s` (`Compute::touch_bytes_per_s`, 0: infinite): a preset
    /// with overrides (the link keys are those of `COMMFUSE_CPU_LINK`); and
    /// the network between nodes: `gpus_per_node` (devices per node),
    /// `net_gbytes_per_s`, `net_latency_us` (per device and direction). A
    /// machine without a network gets one from `gpus_per_node`, with
    /// InfiniBand NDR's figures ([`Network::NDR_PER_DEVICE`]) unless the
    /// `net_` keys say otherwise.
    pub fn from_spec(spec: &str, gemm_gflops: Option<f64>, cores: usize) -> Result<Machine> {
        let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
        let name = name.trim();
        let bad = |why: String| Error::InvalidArgument(format!("machine {spec:?}: {why}"));
        let mut gflops = gemm_gflops;
        let mut fields = vec![];
        for field in rest.split(',').map(str::trim).filter(|f| !f.is_empty()) {
            let (key, value) = field.split_once('=').ok_or_else(|| bad(format!("`{field}` is not key=value")))?;
            fields.push((key.trim(), value.trim()));
        }
        let number = |key: &str, value: &str| -> Result<f64> {
            match value.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
                _ => Err(bad(format!("`{key}` must be a non-negative number, got {value:?}"))),
            }
        };
        for (key, value) in &fields {
            if *key == "gemm_gflops" {
                gflops = Some(number(key, value)?);
            }
        }
        let mut machine = Machine::preset(name, gflops, cores)
            .ok_or_else(|| bad(format!("unknown machine {name:?}; expected one of {}", PRESETS.join(", "))))?;
        for &(key, value) in &fields {
            match key {
                "gemm_gflops" => {}
                "gbytes_per_s" => {
                    let v = number(key, value)?;
                    machine.link.bytes_per_s = if v > 0.0 { v * 1e9 } else { f64::INFINITY };
                }
                "latency_us" => machine.link.latency_s = number(key, value)? * 1e-6,
                "mem_gbytes_per_s" => machine.compute.memory_bytes_per_s = number(key, value)?.max(1e-9) * 1e9,
                "touch_gbytes_per_s" => {
                    // 0, as for the link: nothing to pay (the rate unmeasurable).
                    let v = number(key, value)?;
                    machine.compute.touch_bytes_per_s = if v > 0.0 { v * 1e9 } else { f64::INFINITY };
                }
                "topology" => {
                    machine.link.topology = match value {
                        "switch" => Topology::Switch,
                        "ring" => Topology::Ring,
                        _ => return Err(bad(format!("unknown topology {value:?}; expected switch or ring"))),
                    }
                }
                "gpus_per_node" => {
                    let devices = match value.parse::<usize>() {
                        Ok(d) if d >= 1 => d,
                        _ => return Err(bad(format!("`{key}` must be a whole number >= 1, got {value:?}"))),
                    };
                    let link = machine.network.map_or(Network::NDR_PER_DEVICE, |n| n.link);
                    machine.network = Some(Network { devices_per_node: devices, link });
                }
                "net_gbytes_per_s" | "net_latency_us" | "across_nodes" => {}
                _ => {
                    return Err(bad(format!(
                        "unknown key {key:?}; expected gbytes_per_s, latency_us, topology, gemm_gflops, \
                         mem_gbytes_per_s, touch_gbytes_per_s, gpus_per_node, net_gbytes_per_s, net_latency_us, across_nodes"
                    )))
                }
            }
        }
        // The network's figures apply once `gpus_per_node` has made one, in any order.
        let mut across = false;
        for (key, value) in fields {
            if key == "across_nodes" {
                across = match value {
                    "1" | "true" => true,
                    "0" | "false" => false,
                    _ => return Err(bad(format!("`across_nodes` must be 1 or 0, got {value:?}"))),
                };
                continue;
            }
            let network = match key {
                "net_gbytes_per_s" | "net_latency_us" => machine.network.as_mut().ok_or_else(|| {
                    bad(format!("`{key}` describes the network between nodes: give `gpus_per_node` too"))
                })?,
                _ => continue,
            };
            let v = number(key, value)?;
            if key == "net_gbytes_per_s" {
                network.link.bytes_per_s = if v > 0.0 { v * 1e9 } else { f64::INFINITY };
            } else {
                network.link.latency_s = v * 1e-6;
            }
        }
        if across {
            // A group whose devices span nodes: its transfers cross the network.
            return machine
                .across_nodes()
                .ok_or_else(|| bad("`across_nodes` needs a network between nodes (`gpus_per_node`)".into()));
        }
        Ok(machine)
    }
}
