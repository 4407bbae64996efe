//! What `simulate`, `refit` and `bench` share: the model and parallel specs of a refit, the
//! cluster, the planner config, planning every rank, and the host memory a run needs.

use super::usage;
use crate::args::Parsed;
use crate::models_json::{load_model, load_system, Model};
use crate::work;
use crate::Failure;
use ncclreshard::exec::buffers::RankViews;
use ncclreshard::exec::{rank_program_placed, StagingLimit};
use ncclreshard::layout::Side;
use ncclreshard::plan::DstRange;
use ncclreshard::quant::Conversion;
use ncclreshard::transport::nccl::NcclTransport;
use ncclreshard::{Config, DType, Mode, Planner, RankProgram, TensorSpec, Topology};
use ncclreshard_tools::models::{
    count_parameters, infer_conversions, ExpertStorage, InferDtype, InferSpec, Refit, RefitOptions,
    TrainSpec, PRESETS,
};
use ncclreshard_tools::sim::Cluster;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

/// The refit named on the command line: `--model`, `--train` and `--infer` (or `--system`),
/// `--dtype`, `--infer-dtype`, `--experts`, `--colocated`.
pub struct RefitArgs {
    pub model: Model,
    /// `--train` and `--infer` as the user wrote them (shown in reports).
    pub train_text: String,
    pub infer_text: String,
    pub train: TrainSpec,
    pub infer: InferSpec,
    pub options: RefitOptions,
    /// `--infer-dtype`: what inference stores, when it is not `--dtype`.
    pub infer_dtype: Option<InferDtype>,
}

impl RefitArgs {
    pub fn parse(parsed: &Parsed, command: &'static str) -> Result<RefitArgs, Failure> {
        let required = |name: &str, what: &str| {
            parsed
                .value(name)
                .ok_or_else(|| usage(command, format!("--{name} is required ({what})")))
        };
        let model = required("model", &format!("{} or a file", PRESETS.join(", ")))?;
        let (train, infer, train_text, infer_text) = match parsed.value("system") {
            Some(path) => {
                if parsed.value("train").is_some() || parsed.value("infer").is_some() {
                    return Err(usage(
                        command,
                        "--system gives the training and inference specs; drop --train and --infer",
                    ));
                }
                let (train, infer) = load_system(Path::new(path)).map_err(Failure::Input)?;
                (train, infer, train.to_string(), infer.to_string())
            }
            None => {
                let train_text =
                    required("train", "a training spec like pp16,ep16, or --system FILE")?;
                let infer_text =
                    required("infer", "an inference spec like tp32,dp8, or --system FILE")?;
                let train = TrainSpec::parse(train_text)
                    .map_err(|e| usage(command, format!("--train: {e}")))?;
                let infer = InferSpec::parse(infer_text)
                    .map_err(|e| usage(command, format!("--infer: {e}")))?;
                (train, infer, train_text.to_string(), infer_text.to_string())
            }
        };
        let dtype_name = parsed.value("dtype").unwrap_or("bfloat16");
        let dtype = DType::from_name(dtype_name)
            .ok_or_else(|| usage(command, format!("--dtype: unknown dtype {dtype_name:?}")))?;
        let experts = match parsed.value("experts").unwrap_or("stacked") {
            "stacked" => ExpertStorage::Stacked,
            "per-expert" => ExpertStorage::PerExpert,
            other => {
                return Err(usage(
                    command,
                    format!("--experts {other:?}: expected stacked or per-expert"),
                ))
            }
        };
        let infer_dtype = parsed
            .value("infer-dtype")
            .map(|text| {
                InferDtype::parse(text).map_err(|e| usage(command, format!("--infer-dtype: {e}")))
            })
            .transpose()?
            .filter(|d| *d != InferDtype::Cast(dtype));
        let model = load_model(model).map_err(Failure::Input)?;
        Ok(RefitArgs {
            infer_dtype,
            model,
            train_text,
            infer_text,
            train,
            infer,
            options: RefitOptions {
                dtype,
                colocated: parsed.flag("colocated"),
                experts,
            },
        })
    }

    /// A preset model's refit in BF16 with stacked experts, not colocated, as `--model`,
    /// `--train`, `--infer` and `--infer-dtype` would give it (`calibrate --compare`).
    pub fn preset(
        model: &str,
        train: &str,
        infer: &str,
        infer_dtype: &str,
    ) -> Result<RefitArgs, Failure> {
        let input = |e: String| Failure::Input(e);
        let dtype = DType::Bfloat16;
        Ok(RefitArgs {
            model: load_model(model).map_err(input)?,
            train_text: train.to_string(),
            infer_text: infer.to_string(),
            train: TrainSpec::parse(train).map_err(|e| input(e.to_string()))?,
            infer: InferSpec::parse(infer).map_err(|e| input(e.to_string()))?,
            options: RefitOptions {
                dtype,
                colocated: false,
                experts: ExpertStorage::Stacked,
            },
            infer_dtype: Some(InferDtype::parse(infer_dtype).map_err(|e| input(e.to_string()))?)
                .filter(|d| *d != InferDtype::Cast(dtype)),
        })
    }

    /// The refit of the model with widths divided by `scale` (1: the model itself).
    pub fn refit(&self, scale: u64) -> Result<Refit, Failure> {
        self.model
            .scaled(scale)
            .and_then(|model| model.refit(&self.train, &self.infer, &self.options))
            .map_err(Failure::Input)
    }

    /// Each tensor's conversion in `refit` (the model with widths divided by `scale`) under
    /// `--infer-dtype`; all `None` without it.
    pub fn conversions(
        &self,
        refit: &Refit,
        scale: u64,
    ) -> Result<Vec<Option<Conversion>>, Failure> {
        let Some(infer) = self.infer_dtype else {
            return Ok(vec![None; refit.tensors.len()]);
        };
        let params = self
            .model
            .scaled(scale)
            .map_err(Failure::Input)?
            .params(self.options.experts);
        // The refit lists the inventory's parameters in its order (`Refit`'s contract).
        if params.len() != refit.names.len()
            || params.iter().zip(&refit.names).any(|(p, n)| &p.name != n)
        {
            return Err(Failure::Input(format!(
                "{}: the refit's tensors are not the model's parameters in order",
                self.model.name()
            )));
        }
        Ok(infer_conversions(&params, self.options.dtype, infer))
    }

    /// `--infer-dtype` as given, or `--dtype` when it is not.
    pub fn infer_dtype_name(&self) -> String {
        self.infer_dtype
            .map_or_else(|| self.options.dtype.to_string(), |d| d.name())
    }

    /// `train tp4,pp4,dp2 (ranks 0-31) → infer tp4,dp8 (ranks 32-63)`.
    pub fn specs_text(&self, refit: &Refit) -> String {
        format!(
            "train {} ({}) → infer {} ({}){}",
            self.train_text,
            ranks_text(&refit.train_ranks),
            self.infer_text,
            ranks_text(&refit.infer_ranks),
            if self.options.colocated {
                ", colocated"
            } else {
                ""
            }
        )
    }

    /// Model parameters (weights and biases, not FP8 scales) of the full-size model.
    pub fn parameters(&self) -> u64 {
        count_parameters(&self.model.params(self.options.experts))
    }

    pub fn experts_name(&self) -> &'static str {
        match self.options.experts {
            ExpertStorage::Stacked => "stacked",
            ExpertStorage::PerExpert => "per-expert",
        }
    }
}

/// `32 ranks 0-31`.
pub fn ranks_text(ranks: &Range<u32>) -> String {
    format!(
        "{} ranks {}-{}",
        ranks.len(),
        ranks.start,
        ranks.end.saturating_sub(1)
    )
}

/// `--scale N` (at least 1), or `default`.
pub fn scale(parsed: &Parsed, command: &'static str, default: u64) -> Result<u64, Failure> {
    match parsed
        .number::<u64>("scale")
        .map_err(|e| usage(command, e))?
    {
        Some(0) => Err(usage(command, "--scale must be at least 1")),
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

/// `--cluster PRESET|key=value,...`, default `dgx-h100`.
pub fn cluster(parsed: &Parsed, command: &'static str) -> Result<Cluster, Failure> {
    match parsed.value("cluster") {
        None => Ok(Cluster::dgx_h100()),
        Some(text) => Cluster::parse(text).map_err(|e| usage(command, format!("--cluster: {e}"))),
    }
}

/// `--mode`, default auto.
pub fn mode(parsed: &Parsed, command: &'static str) -> Result<Mode, Failure> {
    parsed
        .value("mode")
        .map_or(Ok(Mode::Auto), Mode::parse)
        .map_err(|e| usage(command, format!("--mode: {e}")))
}

/// The planner config for a refit on `cluster`: a "node" for the planner is what NVLink
/// connects (one DGX node; a whole GB200 NVL72 rack), since sender choice prefers NVLink.
pub fn config(mode: Mode, cluster: &Cluster) -> Config {
    Config {
        mode,
        topology: Topology::RanksPerNode(cluster.nvlink_domain),
        ..Default::default()
    }
}

/// [`config`] with `--rounds N` and `--no-relay` applied.
pub fn config_with_options(
    parsed: &Parsed,
    command: &'static str,
    mode: Mode,
    cluster: &Cluster,
) -> Result<Config, Failure> {
    let mut config = config(mode, cluster);
    if let Some(text) = parsed.value("rounds") {
        config.rounds = text
            .parse()
            .ok()
            .filter(|&r| r <= ncclreshard::plan::MAX_ROUNDS)
            .ok_or_else(|| {
                usage(
                    command,
                    format!(
                        "--rounds: {text:?} is not 0 (automatic) to {}",
                        ncclreshard::plan::MAX_ROUNDS
                    ),
                )
            })?;
    }
    config.relay = !parsed.flag("no-relay");
    Ok(config)
}

/// `--sender-barrier auto|on|off` ([`Config::sender_barrier`]: `None`, `Some(true)`,
/// `Some(false)`), default auto.
pub fn sender_barrier(parsed: &Parsed, command: &'static str) -> Result<Option<bool>, Failure> {
    match parsed.value("sender-barrier") {
        None | Some("auto") => Ok(None),
        Some("on") => Ok(Some(true)),
        Some("off") => Ok(Some(false)),
        Some(other) => Err(usage(
            command,
            format!("--sender-barrier {other:?}: expected auto, on or off"),
        )),
    }
}

/// The name of a [`Config::sender_barrier`] setting, as `--sender-barrier` takes it.
pub fn sender_barrier_name(setting: Option<bool>) -> &'static str {
    match setting {
        None => "auto",
        Some(true) => "on",
        Some(false) => "off",
    }
}

/// The planner of `tensors` with their `conversions` (one per tensor, `None`: as it is).
pub fn planner(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    config: Config,
) -> Result<Planner, Failure> {
    Planner::with_conversions(tensors.to_vec(), conversions.to_vec(), config)
        .map_err(|e| Failure::Input(e.to_string()))
}

/// Where a rank's destination views sit (`--views`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Views {
    /// One buffer per view (`ncclReshardMulti` with separate allocations): the planner knows
    /// nothing of where they sit.
    Separate,
    /// Back to back in tensor order, scale views after them, in one destination buffer (the
    /// single-buffer `ncclReshard` with offsets in descriptor order): staged receives whose
    /// data lands on adjacent views are received in place (docs/executor.md, "Receiving in
    /// place").
    Packed,
}

impl Views {
    /// `--views separate|packed` (default separate).
    pub fn parse(parsed: &Parsed, command: &'static str) -> Result<Views, Failure> {
        match parsed.value("views") {
            None | Some("separate") => Ok(Views::Separate),
            Some("packed") => Ok(Views::Packed),
            Some(other) => Err(usage(
                command,
                format!("--views {other:?}: expected separate or packed"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Views::Separate => "separate",
            Views::Packed => "packed",
        }
    }

    /// `rank`'s destination views as this layout places them, for the planner.
    fn ranges(self, planner: &Planner, rank: u32) -> Option<Vec<Option<DstRange>>> {
        if self == Views::Separate {
            return None;
        }
        let n = planner.tensors().len();
        let extents = RankViews::with_conversions(
            rank,
            planner.tensors(),
            planner.conversions(),
            &vec![(0, 0); n],
            &vec![0; n],
            vec![None; n],
        )
        .ok()?;
        let mut at = 0u64;
        Some(
            extents
                .tensors()
                .iter()
                .map(|v| {
                    v.dst.map(|r| {
                        let range = DstRange {
                            offset: at,
                            bytes: r.bytes,
                        };
                        at += r.bytes;
                        range
                    })
                })
                .collect(),
        )
    }
}

/// Every rank's program, planned on all cores with a progress line, its destination views
/// placed as `views` says; and the wall time.
pub fn plan_all(
    planner: &Planner,
    views: Views,
    label: &str,
) -> Result<(Vec<RankProgram>, Duration), Failure> {
    let ranks = planner.ranks();
    let (programs, took) = work::track(label, ranks.len(), |done| {
        work::map(&ranks, done, |&rank| {
            // As ncclReshardPlanCreate plans it (the staging limit, the NCCL transport's).
            let placed = views.ranges(planner, rank);
            rank_program_placed(
                planner,
                rank,
                StagingLimit::new(0),
                NcclTransport::LIMITS,
                placed.as_deref(),
            )
            .map_err(|e| Failure::Input(format!("rank {rank}: {e}")))
        })
    });
    Ok((programs.into_iter().collect::<Result<_, _>>()?, took))
}

/// Host bytes of every rank's source and destination views (what a host run allocates).
pub fn host_bytes(tensors: &[TensorSpec]) -> u64 {
    let mut total = 0u64;
    for spec in tensors {
        for side in [Side::Src, Side::Dst] {
            for &rank in spec.layout(side).mesh.ranks() {
                if let Some(v) = spec.rank_view(side, rank) {
                    total = total.saturating_add(v.view.extent_bytes());
                }
            }
        }
    }
    total
}
