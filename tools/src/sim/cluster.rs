//! The cluster model: where each rank's GPU sits, how fast its links really are, how the
//! scale-out fabric is wired, and what NCCL's point-to-point engine costs per message, per
//! round and per peer. Every default and its public source is listed in docs/simulator.md §1.

use ncclreshard::error::{Error, Result};

/// Bytes per second in one GB/s (decimal, like NIC and NVLink datasheets).
const GB: f64 = 1e9;

/// A GPU cluster as the simulator sees it. Rank `r` runs on GPU `r`: node `r / gpus_per_node`,
/// NVLink domain `r / nvlink_domain`, rail `r % gpus_per_node` (one NIC per GPU, wired to the
/// leaf switch of its rail: a rail-optimised fabric). Two GPUs in one NVLink domain talk over
/// NVLink (on GB200 NVL72 also across compute trays); others through NICs. Bandwidths are per
/// GPU and per direction, in bytes per second, as rated; `*_efficiency` is the fraction NCCL
/// reaches on them.
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
    /// Rated NVLink bandwidth of one GPU, each direction.
    pub nvlink_bw: f64,
    /// Rated scale-out NIC bandwidth of one GPU, each direction.
    pub nic_bw: f64,
    /// Fraction of `nvlink_bw` NCCL reaches (≈ 370 of 450 GB/s on H100).
    pub nvlink_efficiency: f64,
    /// Fraction of `nic_bw` NCCL reaches (≈ 46–48 of 50 GB/s on a 400 Gb/s NIC).
    pub nic_efficiency: f64,
    /// Nodes under one leaf switch per rail (the scalable unit of a rail-optimised fabric).
    /// Traffic between scalable units, or between rails without PXN, crosses the spine.
    pub nodes_per_leaf: u32,
    /// Leaf downlink : uplink bandwidth (1 = non-blocking, 2 = half the bandwidth up).
    pub oversubscription: f64,
    /// NCCL's PXN (its default, `NCCL_P2P_PXN_LEVEL=2`): a message to a GPU on another rail
    /// first crosses NVLink to the sender's node-local GPU on the receiver's rail and leaves
    /// through that GPU's NIC, so it stays under one leaf. Off: it leaves through the
    /// sender's own NIC and crosses the spine.
    pub pxn: bool,
    /// Cost of one point-to-point message between GPUs of different NVLink domains, serial on
    /// its (sender, receiver) pair (NCCL's per-step network latency, Simple protocol).
    pub latency_s: f64,
    /// The same over NVLink.
    pub nvlink_latency_s: f64,
    /// Host time to post one `ncclSend` or `ncclRecv` (serial on the rank's host thread).
    pub host_op_s: f64,
    /// Fixed cost of one NCCL group (NCCL's base latency), per group.
    pub group_s: f64,
    /// One CUDA kernel launch (a pack, an unpack, a local copy).
    pub launch_s: f64,
    /// Bandwidth one NCCL channel reaches to one network peer (`NCCL_P2P_PER_CHANNEL_NET_BW`).
    pub p2p_channel_bw: f64,
    /// NCCL's point-to-point channels per rank (`p2pnChannels`); with the number of ranks it
    /// sets the channels one network peer gets (`p2p_channels_per_peer`).
    pub p2p_channels: u32,
    /// Bytes `cudaMemcpy` copies device-to-device per second (reads and writes each that
    /// many bytes of HBM); the copy kernel reaches a fraction of it that depends on the
    /// contiguous run length (`copy_efficiency`).
    pub hbm_copy_bw: f64,
    /// Device memory of one GPU in bytes (what `torch.cuda.get_device_properties().
    /// total_memory` reports); NeMo RL sizes its broadcast buckets from it.
    pub gpu_memory_bytes: u64,
    /// Device memory free for a refit's staging and NCCL buffers on every GPU.
    pub free_memory_bytes: u64,
    /// One-time: connecting one (peer, channel) NCCL connection, serial per rank.
    pub connect_s: f64,
    /// One-time: compiling the copy kernel with NVRTC on first use.
    pub compile_s: f64,
    /// Monte Carlo jitter: mean of the exponential delay added to each rank's start of each
    /// round (host scheduling, launch and proxy-thread noise).
    pub jitter_s: f64,
    /// Monte Carlo jitter: mean of the exponential relative slowdown of each flow (routing
    /// collisions, retransmits).
    pub flow_jitter: f64,
}

impl Cluster {
    /// NVIDIA DGX H100 in a DGX SuperPOD: 8 GPUs per node and NVLink domain (NVLink 4,
    /// 450 GB/s), 8 × ConnectX-7 400 Gb/s (50 GB/s per GPU), rail-optimised leaves of 32
    /// nodes, a non-blocking spine, 80 GB GPUs. See docs/simulator.md §1.
    pub fn dgx_h100() -> Cluster {
        Cluster {
            name: "dgx-h100".to_string(),
            gpus_per_node: 8,
            nvlink_domain: 8,
            nvlink_bw: 450.0 * GB,
            nic_bw: 50.0 * GB,
            nvlink_efficiency: 370.0 / 450.0,
            nic_efficiency: 0.94,
            nodes_per_leaf: 32,
            oversubscription: 1.0,
            pxn: true,
            latency_s: 14e-6,
            nvlink_latency_s: 3.4e-6,
            host_op_s: 1e-6,
            group_s: 8.4e-6,
            launch_s: 4e-6,
            p2p_channel_bw: 14.0 * GB,
            p2p_channels: 32,
            hbm_copy_bw: 1470.0 * GB,
            gpu_memory_bytes: 85_520_809_984,
            free_memory_bytes: 8_552_080_998,
            connect_s: 0.5e-3,
            compile_s: 0.5,
            jitter_s: 20e-6,
            flow_jitter: 0.02,
        }
    }

    /// NVIDIA GB200 NVL72: 4 GPUs per compute tray, 72 GPUs in one NVLink domain (NVLink 5,
    /// 900 GB/s), one 400 Gb/s NIC per GPU, rail-optimised leaves of 8 racks (144 trays),
    /// 186 GB GPUs.
    pub fn gb200_nvl72() -> Cluster {
        Cluster {
            name: "gb200-nvl72".to_string(),
            gpus_per_node: 4,
            nvlink_domain: 72,
            nvlink_bw: 900.0 * GB,
            nodes_per_leaf: 144,
            hbm_copy_bw: 3500.0 * GB,
            gpu_memory_bytes: 186_000_000_000,
            free_memory_bytes: 18_600_000_000,
            ..Cluster::dgx_h100()
        }
    }

    /// Names accepted by [`Cluster::preset`].
    pub const PRESETS: [&'static str; 2] = ["dgx-h100", "gb200-nvl72"];

    /// Every key [`Cluster::set`] accepts.
    pub const KEYS: [&'static str; 27] = [
        "name",
        "gpus_per_node",
        "nvlink_domain",
        "nvlink_gbs",
        "nic_gbs",
        "nic_gbits",
        "nvlink_efficiency",
        "nic_efficiency",
        "nodes_per_leaf",
        "oversubscription",
        "pxn",
        "latency_us",
        "nvlink_latency_us",
        "host_op_us",
        "group_us",
        "launch_us",
        "p2p_channel_gbs",
        "p2p_channels",
        "hbm_copy_gbs",
        "gpu_memory_gb",
        "free_memory_gb",
        "connect_ms",
        "compile_ms",
        "jitter_us",
        "flow_jitter",
        "ideal",
        "no_costs",
    ];

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

    /// A cluster with the given shape and rated bandwidths (bytes per second, per GPU per
    /// direction) and the DGX H100 defaults for everything else.
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

    /// The same cluster with links at their rated speed, an ideal fabric and no per-message,
    /// per-round or jitter costs: what the simulator assumed before it was calibrated. Useful
    /// to see how much of an estimate the engine costs are.
    pub fn ideal(&self) -> Cluster {
        Cluster {
            nvlink_efficiency: 1.0,
            nic_efficiency: 1.0,
            oversubscription: 1.0,
            p2p_channel_bw: f64::INFINITY,
            ..self.without_costs()
        }
    }

    /// The same cluster without per-message, per-round, setup or jitter costs (bandwidths
    /// and fabric unchanged).
    pub fn without_costs(&self) -> Cluster {
        Cluster {
            latency_s: 0.0,
            nvlink_latency_s: 0.0,
            host_op_s: 0.0,
            group_s: 0.0,
            launch_s: 0.0,
            connect_s: 0.0,
            compile_s: 0.0,
            jitter_s: 0.0,
            flow_jitter: 0.0,
            ..self.clone()
        }
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
            Some((first, rest)) if !first.contains('=') && !Cluster::is_flag(first) => {
                (Cluster::preset(first)?, rest)
            }
            _ => {
                let mut base = Cluster::dgx_h100();
                base.name = "custom".to_string();
                (base, items.as_slice())
            }
        };
        for item in rest {
            if Cluster::is_flag(item) {
                cluster.set(item, "")?;
                continue;
            }
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

    fn is_flag(item: &str) -> bool {
        matches!(item, "ideal" | "no_costs")
    }

    /// Sets one parameter from text. Keys carry their units: `name`, `gpus_per_node`,
    /// `nvlink_domain`, `nvlink_gbs`, `nic_gbs`, `nic_gbits` (per GPU, e.g. 400 → 50 GB/s),
    /// `nvlink_efficiency`, `nic_efficiency` (0 < f ≤ 1), `nodes_per_leaf`,
    /// `oversubscription` (≥ 1), `pxn` (0/1), `latency_us`, `nvlink_latency_us`,
    /// `host_op_us`, `group_us`, `launch_us`, `p2p_channel_gbs`, `p2p_channels`,
    /// `hbm_copy_gbs`, `gpu_memory_gb` (also sets free memory to 10 % of it),
    /// `free_memory_gb`, `connect_ms`, `compile_ms`, `jitter_us`, `flow_jitter`; and the
    /// value-less `ideal` ([`Cluster::ideal`]) and `no_costs` ([`Cluster::without_costs`]).
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
            "nvlink_efficiency" => self.nvlink_efficiency = number()?,
            "nic_efficiency" => self.nic_efficiency = number()?,
            "nodes_per_leaf" => self.nodes_per_leaf = count()?,
            "oversubscription" => self.oversubscription = number()?,
            "pxn" => {
                self.pxn = match value {
                    "1" | "true" | "on" => true,
                    "0" | "false" | "off" => false,
                    _ => {
                        return Err(Error::invalid_argument(format!(
                            "cluster pxn={value:?}: expected 0 or 1"
                        )))
                    }
                }
            }
            "latency_us" => self.latency_s = number()? * 1e-6,
            "nvlink_latency_us" => self.nvlink_latency_s = number()? * 1e-6,
            "host_op_us" => self.host_op_s = number()? * 1e-6,
            "group_us" => self.group_s = number()? * 1e-6,
            "launch_us" => self.launch_s = number()? * 1e-6,
            "p2p_channel_gbs" => self.p2p_channel_bw = number()? * GB,
            "p2p_channels" => self.p2p_channels = count()?,
            "hbm_copy_gbs" => self.hbm_copy_bw = number()? * GB,
            "gpu_memory_gb" => {
                self.gpu_memory_bytes = (number()? * GB) as u64;
                self.free_memory_bytes = self.gpu_memory_bytes / 10;
            }
            "free_memory_gb" => self.free_memory_bytes = (number()? * GB) as u64,
            "connect_ms" => self.connect_s = number()? * 1e-3,
            "compile_ms" => self.compile_s = number()? * 1e-3,
            "jitter_us" => self.jitter_s = number()? * 1e-6,
            "flow_jitter" => self.flow_jitter = number()?,
            "ideal" => *self = self.ideal(),
            "no_costs" => *self = self.without_costs(),
            other => {
                return Err(Error::invalid_argument(format!(
                    "cluster key {other:?} is not one of {}",
                    Cluster::KEYS.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// Checks every parameter; the message names the key.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |key: &str, why: &str| Err(Error::invalid_argument(format!("cluster {key} {why}")));
        for (key, value) in [
            ("gpus_per_node", self.gpus_per_node),
            ("nvlink_domain", self.nvlink_domain),
            ("nodes_per_leaf", self.nodes_per_leaf),
            ("p2p_channels", self.p2p_channels),
        ] {
            if value == 0 {
                return bad(key, "must be at least 1");
            }
        }
        for (key, value) in [
            ("nvlink_gbs", self.nvlink_bw),
            ("nic_gbs", self.nic_bw),
            ("hbm_copy_gbs", self.hbm_copy_bw),
            ("p2p_channel_gbs", self.p2p_channel_bw),
        ] {
            if value.is_nan() || value <= 0.0 {
                return bad(key, "must be a positive bandwidth");
            }
        }
        for (key, value) in [
            ("nvlink_efficiency", self.nvlink_efficiency),
            ("nic_efficiency", self.nic_efficiency),
        ] {
            if !(value > 0.0 && value <= 1.0) {
                return bad(key, "must be in (0, 1]");
            }
        }
        if !(self.oversubscription.is_finite() && self.oversubscription >= 1.0) {
            return bad("oversubscription", "must be 1 or more");
        }
        for (key, value) in [
            ("latency_us", self.latency_s),
            ("nvlink_latency_us", self.nvlink_latency_s),
            ("host_op_us", self.host_op_s),
            ("group_us", self.group_s),
            ("launch_us", self.launch_s),
            ("connect_ms", self.connect_s),
            ("compile_ms", self.compile_s),
            ("jitter_us", self.jitter_s),
            ("flow_jitter", self.flow_jitter),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return bad(key, "must be zero or more");
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

    /// The rail of `rank`'s NIC: its GPU's index inside the node.
    pub fn rail(&self, rank: u32) -> u32 {
        rank % self.gpus_per_node
    }

    /// The scalable unit (set of nodes under one leaf per rail) of `rank`.
    pub fn leaf_group(&self, rank: u32) -> u32 {
        self.node(rank) / self.nodes_per_leaf
    }

    /// True when `a` and `b` talk over NVLink.
    pub fn same_domain(&self, a: u32, b: u32) -> bool {
        self.domain(a) == self.domain(b)
    }

    /// Rated bandwidth of the link one GPU uses to reach another (NVLink or NIC).
    pub fn link_bw(&self, from: u32, to: u32) -> f64 {
        if self.same_domain(from, to) {
            self.nvlink_bw
        } else {
            self.nic_bw
        }
    }

    /// NVLink bandwidth NCCL reaches.
    pub fn nvlink_achievable(&self) -> f64 {
        self.nvlink_bw * self.nvlink_efficiency
    }

    /// NIC bandwidth NCCL reaches.
    pub fn nic_achievable(&self) -> f64 {
        self.nic_bw * self.nic_efficiency
    }

    /// Capacity of one leaf switch's uplinks (or downlinks from the spine) for one rail.
    pub fn leaf_uplink_bw(&self) -> f64 {
        f64::from(self.nodes_per_leaf) * self.nic_achievable() / self.oversubscription
    }

    /// Channels NCCL gives one network peer in a communicator of `ranks` ranks, by NCCL's
    /// rule (`src/graph/paths.cc`): enough channels to fill the NIC at
    /// `p2p_channel_bw` each, halved while every peer's channels would not fit into
    /// `p2p_channels` channels of 8 operations each.
    pub fn p2p_channels_per_peer(&self, ranks: usize) -> u32 {
        let wanted = (self.nic_bw / self.p2p_channel_bw).ceil();
        let mut channels = if wanted.is_finite() {
            (wanted as u32).max(1)
        } else {
            1
        };
        let batches = ranks.div_ceil(8).max(1) as u64;
        while channels > 1 && u64::from(channels) * batches > u64::from(self.p2p_channels) {
            channels /= 2;
        }
        channels
    }

    /// The most bandwidth one (sender, receiver) network pair gets in a communicator of
    /// `ranks` ranks: its channels at `p2p_channel_bw` each, at most the NIC.
    pub fn p2p_peer_cap(&self, ranks: usize) -> f64 {
        (f64::from(self.p2p_channels_per_peer(ranks)) * self.p2p_channel_bw)
            .min(self.nic_achievable())
    }

    /// Per-message cost between `from` and `to` (NVLink or network).
    pub fn message_latency(&self, from: u32, to: u32) -> f64 {
        if self.same_domain(from, to) {
            self.nvlink_latency_s
        } else {
            self.latency_s
        }
    }

    /// Bytes per second a framework's copy kernel (`torch.cat`, M2N's packs) copies in long
    /// contiguous runs: `FRAMEWORK_COPY_EFFICIENCY` of `hbm_copy_bw`.
    pub fn contiguous_copy_bw(&self) -> f64 {
        self.hbm_copy_bw * Cluster::FRAMEWORK_COPY_EFFICIENCY
    }

    /// Fraction of `hbm_copy_bw` other projects' copy kernels reach on long contiguous runs
    /// (`torch.cat` in gather + broadcast, M2N's packs): not measured here; 0.92 is what a
    /// tuned 16-byte-per-lane copy kernel reached on an H200 (this library's before 0.5).
    pub const FRAMEWORK_COPY_EFFICIENCY: f64 = 0.92;

    /// Fraction of `hbm_copy_bw` the copy kernel reaches on `run_bytes`-long contiguous runs
    /// whose addresses and lengths are multiples of `align` bytes (at most 16): measured on an
    /// H200 (`scripts/gpu-check.sh`, 0.13.0, kernel against `cudaMemcpy` of the same bytes)
    /// at 0.845 for 1 GiB contiguous, 0.83 for 64 KiB rows, 0.78 for 4 KiB rows and 0.40 / 0.61
    /// for 64-byte rows at 80- / 128-byte pitches (taken as 0.50), interpolated linearly in the
    /// logarithm of the row length between those points; shorter rows than 64 bytes 0.50 × L/64.
    /// Rows aligned to 2–8 bytes (funnel-shifted 16-byte units): 0.83 of that (bf16 rows of
    /// 1023 elements measured 0.61 against 0.73 for aligned 2 KiB rows). Rows of
    /// odd byte alignment (not measured): 0.9 of the shifted speed from 64 bytes, 0.3 below.
    pub fn copy_efficiency(run_bytes: u64, align: u64) -> f64 {
        const MEASURED: [(f64, f64); 4] = [
            (64.0, 0.50),
            (4096.0, 0.78),
            (65536.0, 0.83),
            (1073741824.0, 0.845),
        ];
        let run = run_bytes.max(1) as f64;
        let by_run = if run < MEASURED[0].0 {
            MEASURED[0].1 * run / MEASURED[0].0
        } else if run >= MEASURED[3].0 {
            MEASURED[3].1
        } else {
            let k = MEASURED.windows(2).position(|w| run < w[1].0).unwrap_or(2);
            let ((l0, e0), (l1, e1)) = (MEASURED[k], MEASURED[k + 1]);
            e0 + (e1 - e0) * (run / l0).ln() / (l1 / l0).ln()
        };
        let shifted = 0.83 * by_run;
        match align {
            16.. => by_run,
            2..=15 => shifted,
            _ if run >= 64.0 => 0.9 * shifted,
            _ => shifted.min(0.3),
        }
    }

    /// Fraction of the call's copy speed late unpacks get on their side stream: half the SMs
    /// (the rest stay free for the next round's NCCL kernels; docs/executor.md).
    pub const LATE_UNPACK_SHARE: f64 = 0.5;

    /// Fraction of `cudaMemcpy`'s HBM traffic rate the conversion kernels reach on theirs:
    /// measured on an H200 (`scripts/gpu-check.sh`, 0.13.0) at 0.32 for BF16 to FP8 E4M3 in
    /// 128×128 blocks (512 MiB of BF16 in 1.41 ms: amax, scales and values passes, and the
    /// one-rank test's local copy of the FP8 bytes, which runs on the side stream on half the
    /// SMs: so a lower bound for the conversion passes alone), the only scheme measured so
    /// far; casts and other schemes are taken as the same.
    pub const CONVERT_EFFICIENCY: f64 = 0.32;
}
