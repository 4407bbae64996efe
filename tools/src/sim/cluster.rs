//! The cluster model: where each rank's GPU sits and how fast its links are.

use ncclreshard::error::{Error, Result};

/// Bytes per second in one GB/s (decimal, like NIC and NVLink datasheets).
const GB: f64 = 1e9;

/// A GPU cluster as the simulator sees it. Rank `r` runs on GPU `r`: node `r / gpus_per_node`,
/// NVLink domain `r / nvlink_domain`. Two GPUs in one NVLink domain talk over NVLink (even
/// across nodes, as in a GB200 NVL72 rack); others through their NICs, one NIC per GPU
/// (rail-optimised). All bandwidths are per GPU and per direction, in bytes per second.
///
/// Plain data: build one with a preset, [`Cluster::custom`] or [`Cluster::parse`], then adjust
/// fields freely; [`Cluster::validate`] checks them.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// Shown in reports (`dgx-h100`, `gb200-nvl72`, `custom`).
    pub name: String,
    pub gpus_per_node: u32,
    /// GPUs per NVLink domain: equal to `gpus_per_node` on DGX systems, 72 on GB200 NVL72.
    pub nvlink_domain: u32,
    /// NVLink bandwidth of one GPU, each direction.
    pub nvlink_bw: f64,
    /// Scale-out NIC bandwidth of one GPU, each direction.
    pub nic_bw: f64,
    /// Fixed cost of one point-to-point message (posting, rendezvous, first byte), in seconds.
    pub latency_s: f64,
    /// Bytes a pack/unpack/local-copy kernel copies per second (reads and writes each that
    /// many bytes of HBM).
    pub hbm_copy_bw: f64,
    /// If set, one peer-to-peer flow gets at most this fraction of a link (NCCL drives a single
    /// peer over a limited number of channels). `None`: one flow can fill a link.
    pub peer_fraction: Option<f64>,
    /// Device memory of one GPU in bytes (what `torch.cuda.get_device_properties().
    /// total_memory` reports); NeMo RL sizes its broadcast buckets from it.
    pub gpu_memory_bytes: u64,
}

impl Cluster {
    /// NVIDIA DGX H100: 8 GPUs per node and NVLink domain, NVLink 4 at 450 GB/s per GPU per
    /// direction, 8 × ConnectX-7 400 Gb/s (50 GB/s per GPU per direction), HBM3 copies at
    /// 1.4 TB/s (≈ 2.8 TB/s of HBM read + write), 80 GB GPUs. See docs/simulator.md.
    pub fn dgx_h100() -> Cluster {
        Cluster {
            name: "dgx-h100".to_string(),
            gpus_per_node: 8,
            nvlink_domain: 8,
            nvlink_bw: 450.0 * GB,
            nic_bw: 50.0 * GB,
            latency_s: 10e-6,
            hbm_copy_bw: 1400.0 * GB,
            peer_fraction: None,
            gpu_memory_bytes: 85_520_809_984,
        }
    }

    /// NVIDIA GB200 NVL72: 4 GPUs per compute tray, 72 GPUs in one NVLink domain at 900 GB/s
    /// per GPU per direction, one 400 Gb/s NIC (50 GB/s) per GPU for scale-out, HBM3e copies at
    /// 3 TB/s, 186 GB GPUs.
    pub fn gb200_nvl72() -> Cluster {
        Cluster {
            name: "gb200-nvl72".to_string(),
            gpus_per_node: 4,
            nvlink_domain: 72,
            nvlink_bw: 900.0 * GB,
            nic_bw: 50.0 * GB,
            latency_s: 10e-6,
            hbm_copy_bw: 3000.0 * GB,
            peer_fraction: None,
            gpu_memory_bytes: 186_000_000_000,
        }
    }

    /// Names accepted by [`Cluster::preset`].
    pub const PRESETS: [&'static str; 2] = ["dgx-h100", "gb200-nvl72"];

    /// A preset by name: `dgx-h100` or `gb200-nvl72`.
    pub fn preset(name: &str) -> Result<Cluster> {
        match name {
            "dgx-h100" => Ok(Cluster::dgx_h100()),
            "gb200-nvl72" => Ok(Cluster::gb200_nvl72()),
            other => Err(Error::invalid_argument(format!(
                "cluster {other:?} is not one of {}; or give key=value pairs",
                Cluster::PRESETS.join(", ")
            ))),
        }
    }

    /// A cluster with the given shape and bandwidths (bytes per second, per GPU per direction)
    /// and the DGX H100 defaults for latency, copy bandwidth and memory.
    pub fn custom(
        gpus_per_node: u32,
        nvlink_domain: u32,
        nvlink_bw: f64,
        nic_bw: f64,
    ) -> Result<Cluster> {
        let cluster = Cluster {
            name: "custom".to_string(),
            gpus_per_node,
            nvlink_domain,
            nvlink_bw,
            nic_bw,
            ..Cluster::dgx_h100()
        };
        cluster.validate()?;
        Ok(cluster)
    }

    /// Parses `PRESET`, `PRESET,key=value,…` or `key=value,…` (commas or whitespace between
    /// items; a spec without a preset starts from `dgx-h100`). Keys are those of
    /// [`Cluster::set`].
    pub fn parse(spec: &str) -> Result<Cluster> {
        let items: Vec<&str> = spec
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .collect();
        let (mut cluster, rest) = match items.split_first() {
            Some((first, rest)) if !first.contains('=') => (Cluster::preset(first)?, rest),
            _ => {
                let mut base = Cluster::dgx_h100();
                base.name = "custom".to_string();
                (base, items.as_slice())
            }
        };
        for item in rest {
            let (key, value) = item.split_once('=').ok_or_else(|| {
                Error::invalid_argument(format!(
                    "cluster item {item:?} is not key=value (only the first item may be a preset name)"
                ))
            })?;
            cluster.set(key.trim(), value.trim())?;
        }
        cluster.validate()?;
        Ok(cluster)
    }

    /// Sets one parameter from text. Keys (units in the name): `name`, `gpus_per_node`,
    /// `nvlink_domain`, `nvlink_gbs`, `nic_gbs`, `nic_gbits` (per GPU, e.g. 400 → 50 GB/s),
    /// `latency_us`, `hbm_copy_gbs`, `peer_fraction` (0 < f ≤ 1, or `none`), `gpu_memory_gb`.
    /// Does not validate the whole cluster; call [`Cluster::validate`] after the last change.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let number = || -> Result<f64> {
            value
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| {
                    Error::invalid_argument(format!("cluster {key}={value:?}: not a number"))
                })
        };
        let count = || -> Result<u32> {
            value.parse::<u32>().map_err(|_| {
                Error::invalid_argument(format!("cluster {key}={value:?}: not a whole number"))
            })
        };
        match key {
            "name" => self.name = value.to_string(),
            "gpus_per_node" => self.gpus_per_node = count()?,
            "nvlink_domain" => self.nvlink_domain = count()?,
            "nvlink_gbs" => self.nvlink_bw = number()? * GB,
            "nic_gbs" => self.nic_bw = number()? * GB,
            "nic_gbits" => self.nic_bw = number()? * GB / 8.0,
            "latency_us" => self.latency_s = number()? * 1e-6,
            "hbm_copy_gbs" => self.hbm_copy_bw = number()? * GB,
            "peer_fraction" => {
                self.peer_fraction = match value {
                    "none" | "" => None,
                    _ => Some(number()?),
                }
            }
            "gpu_memory_gb" => self.gpu_memory_bytes = (number()? * GB) as u64,
            other => {
                return Err(Error::invalid_argument(format!(
                    "cluster key {other:?} is not one of name, gpus_per_node, nvlink_domain, nvlink_gbs, nic_gbs, nic_gbits, latency_us, hbm_copy_gbs, peer_fraction, gpu_memory_gb"
                )))
            }
        }
        Ok(())
    }

    /// Checks every parameter; the message names the key.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |key: &str, why: &str| Err(Error::invalid_argument(format!("cluster {key} {why}")));
        if self.gpus_per_node == 0 {
            return bad("gpus_per_node", "must be at least 1");
        }
        if self.nvlink_domain == 0 {
            return bad("nvlink_domain", "must be at least 1");
        }
        for (key, value) in [
            ("nvlink_gbs", self.nvlink_bw),
            ("nic_gbs", self.nic_bw),
            ("hbm_copy_gbs", self.hbm_copy_bw),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return bad(key, "must be a positive bandwidth");
            }
        }
        if !(self.latency_s.is_finite() && self.latency_s >= 0.0) {
            return bad("latency_us", "must be zero or more");
        }
        if let Some(f) = self.peer_fraction {
            if !(f > 0.0 && f <= 1.0) {
                return bad("peer_fraction", "must be in (0, 1]");
            }
        }
        Ok(())
    }

    /// The node of `rank`'s GPU.
    pub fn node(&self, rank: u32) -> u32 {
        rank / self.gpus_per_node
    }

    /// The NVLink domain of `rank`'s GPU.
    pub fn domain(&self, rank: u32) -> u32 {
        rank / self.nvlink_domain
    }

    /// True when `a` and `b` talk over NVLink.
    pub fn same_domain(&self, a: u32, b: u32) -> bool {
        self.domain(a) == self.domain(b)
    }

    /// Bandwidth of the link one GPU uses to reach another (NVLink or NIC).
    pub fn link_bw(&self, from: u32, to: u32) -> f64 {
        if self.same_domain(from, to) {
            self.nvlink_bw
        } else {
            self.nic_bw
        }
    }
}
