//! Parallelism specs: Megatron/FSDP2-style training and vLLM/SGLang-style inference.

use ncclreshard::error::{Error, Result};
use std::fmt;

/// A training job's parallelism (Megatron-LM, or FSDP2 with the `fsdp` key).
///
/// World = `tp·cp·pp·dp`. Ranks are numbered Megatron's way: tp fastest, then cp, then dp, then
/// pp, so pipeline stage `s` holds the contiguous ranks `s·tp·cp·dp ..`. Within a stage, the
/// expert layers re-factor the same ranks as `[edp, ep, etp]` (etp fastest), `edp =
/// dp·cp·tp / (ep·etp)` — Megatron's rule that `ep·etp` divides `dp·cp·tp`.
///
/// `fsdp` is how many of the `dp` data-parallel ranks shard each parameter (FSDP2's
/// `dp_shard`; `dp / fsdp` replicas, HSDP); 1 means no FSDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TrainSpec {
    pub tp: u32,
    pub cp: u32,
    pub pp: u32,
    pub dp: u32,
    pub ep: u32,
    pub etp: u32,
    pub fsdp: u32,
}

/// An inference engine's parallelism (vLLM / SGLang): `dp` engine replicas of `tp` ranks each,
/// world = `tp·dp`. With expert parallelism the routed experts are spread over all `tp·dp`
/// ranks (vLLM's `--enable-expert-parallel`: EP size = TP × DP) and not tensor-parallel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InferSpec {
    pub tp: u32,
    pub dp: u32,
    pub expert_parallel: bool,
}

/// One side of an NCCL M2N `system_configs/*.json` file (`train` or `generation`), as read by a
/// JSON front end; fields are the file's `*_size` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct M2nSide {
    pub num_gpus: u32,
    pub tp_size: u32,
    pub cp_size: u32,
    pub ep_size: u32,
    pub pp_size: u32,
    pub fsdp_size: u32,
    pub dp_size: u32,
}

/// Splits `tp2,pp4` (or `tp=2, pp=4`) into `(key, value)` pairs; a bare key has no value.
fn pairs<'a>(text: &'a str, what: &str) -> Result<Vec<(&'a str, Option<u32>)>> {
    let mut out: Vec<(&str, Option<u32>)> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let split = item
            .find(|c: char| c.is_ascii_digit() || c == '=')
            .unwrap_or(item.len());
        let (key, value) = item.split_at(split);
        let value = value.strip_prefix('=').unwrap_or(value).trim();
        let value = if value.is_empty() {
            None
        } else {
            match value.parse::<u32>() {
                Ok(0) | Err(_) => {
                    return Err(Error::invalid_argument(format!(
                        "{what} spec {text:?}: {key} = {value:?} is not a positive integer"
                    )))
                }
                Ok(n) => Some(n),
            }
        };
        if out.iter().any(|(k, _)| *k == key) {
            return Err(Error::invalid_argument(format!(
                "{what} spec {text:?}: {key} is given twice"
            )));
        }
        out.push((key, value));
    }
    Ok(out)
}

fn product(factors: &[u32], what: &str) -> Result<u32> {
    factors
        .iter()
        .try_fold(1u32, |acc, &n| acc.checked_mul(n))
        .filter(|&n| n <= i32::MAX as u32)
        .ok_or_else(|| Error::invalid_argument(format!("{what} exceeds NCCL's rank range")))
}

impl TrainSpec {
    /// Builds a spec; `dp = None` picks the smallest data-parallel size that is a multiple of
    /// `fsdp` and lets `ep·etp` divide `dp·cp·tp`. Errors name the offending key.
    pub fn new(
        tp: u32,
        cp: u32,
        pp: u32,
        dp: Option<u32>,
        ep: u32,
        etp: u32,
        fsdp: u32,
    ) -> Result<TrainSpec> {
        for (key, value) in [
            ("tp", tp),
            ("cp", cp),
            ("pp", pp),
            ("ep", ep),
            ("etp", etp),
            ("fsdp", fsdp),
            ("dp", dp.unwrap_or(1)),
        ] {
            if value == 0 {
                return Err(Error::invalid_argument(format!(
                    "training {key} is 0; it must be at least 1"
                )));
            }
        }
        let experts = product(&[ep, etp], "training ep·etp")?;
        let fits = |d: u64| (d * u64::from(cp) * u64::from(tp)) % u64::from(experts) == 0;
        let dp = match dp {
            Some(dp) => {
                if dp % fsdp != 0 {
                    return Err(Error::invalid_argument(format!(
                        "training dp {dp} is not a multiple of fsdp {fsdp}; dp counts every data-parallel rank, fsdp those that shard one copy"
                    )));
                }
                if !fits(u64::from(dp)) {
                    return Err(Error::invalid_argument(format!(
                        "training ep {ep} × etp {etp} does not divide dp·cp·tp = {}; expert parallelism must fit inside the data-, context- and tensor-parallel ranks",
                        u64::from(dp) * u64::from(cp) * u64::from(tp)
                    )));
                }
                dp
            }
            None => {
                let fsdp = u64::from(fsdp);
                let dp = (1..=u64::from(experts))
                    .map(|k| k * fsdp)
                    .find(|&d| fits(d))
                    .expect("dp = fsdp·ep·etp always fits");
                u32::try_from(dp)
                    .map_err(|_| Error::invalid_argument("training dp exceeds NCCL's rank range"))?
            }
        };
        if fsdp > 1 && (ep > 1 || etp > 1) {
            let (key, value) = if ep > 1 { ("ep", ep) } else { ("etp", etp) };
            return Err(Error::invalid_argument(format!(
                "training fsdp {fsdp} with {key} {value}: FSDP2 with expert parallelism is not supported; use Megatron-style dp"
            )));
        }
        product(&[tp, cp, pp, dp], "training world tp·cp·pp·dp")?;
        Ok(TrainSpec {
            tp,
            cp,
            pp,
            dp,
            ep,
            etp,
            fsdp,
        })
    }

    /// Parses `pp16,ep16`, `tp2,cp2,pp4,ep16`, `fsdp8,tp2` … Keys: `tp`, `cp`, `pp`, `dp`,
    /// `ep`, `etp` (expert tensor parallelism, default 1), `fsdp`; each at most once, missing
    /// ones are 1 except `dp` (see [`TrainSpec::new`]). `key=value` is accepted too.
    pub fn parse(text: &str) -> Result<TrainSpec> {
        let mut sizes = [1u32; 6];
        let mut dp = None;
        for (key, value) in pairs(text, "training")? {
            let value = value.ok_or_else(|| {
                Error::invalid_argument(format!(
                    "training spec {text:?}: {key} needs a size (like {key}2)"
                ))
            })?;
            let slot = match key {
                "tp" => 0,
                "cp" => 1,
                "pp" => 2,
                "ep" => 3,
                "etp" => 4,
                "fsdp" => 5,
                "dp" => {
                    dp = Some(value);
                    continue;
                }
                other => {
                    return Err(Error::invalid_argument(format!(
                        "training spec {text:?}: unknown key {other:?}; use tp, cp, pp, dp, ep, etp, fsdp"
                    )))
                }
            };
            sizes[slot] = value;
        }
        let [tp, cp, pp, ep, etp, fsdp] = sizes;
        TrainSpec::new(tp, cp, pp, dp, ep, etp, fsdp)
            .map_err(|e| e.context(format!("training spec {text:?}")))
    }

    /// The training side of an M2N system config. M2N's `dp_size` does not count the ranks
    /// that expert parallelism spans, so `dp` comes from `num_gpus / (tp·cp·pp)`; a `dp_size`
    /// above 1 must agree with it.
    pub fn from_m2n(side: &M2nSide) -> Result<TrainSpec> {
        let model = product(&[side.tp_size, side.cp_size, side.pp_size], "tp·cp·pp")?;
        if model == 0 || side.num_gpus == 0 || side.num_gpus % model != 0 {
            return Err(Error::invalid_argument(format!(
                "train.num_gpus {} is not a multiple of tp_size·cp_size·pp_size = {model}",
                side.num_gpus
            )));
        }
        let dp = side.num_gpus / model;
        if side.dp_size > 1 && side.dp_size != dp {
            return Err(Error::invalid_argument(format!(
                "train.dp_size {} disagrees with num_gpus / (tp·cp·pp) = {dp}",
                side.dp_size
            )));
        }
        TrainSpec::new(
            side.tp_size,
            side.cp_size,
            side.pp_size,
            Some(dp),
            side.ep_size,
            1,
            side.fsdp_size.max(1),
        )
        .map_err(|e| e.context("train"))
    }

    /// Ranks of the training job.
    pub fn world(&self) -> u32 {
        self.tp * self.cp * self.pp * self.dp
    }

    /// Ranks of one pipeline stage.
    pub fn stage_size(&self) -> u32 {
        self.tp * self.cp * self.dp
    }

    /// Expert data-parallel size: replicas of each expert shard within a stage.
    pub fn expert_dp(&self) -> u32 {
        self.stage_size() / (self.ep * self.etp)
    }
}

impl fmt::Display for TrainSpec {
    /// The canonical spec string, every key given (`tp1,cp1,pp16,dp16,ep16,etp1`, plus
    /// `fsdp` when used); it parses back to the same spec.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp{},cp{},pp{},dp{},ep{},etp{}",
            self.tp, self.cp, self.pp, self.dp, self.ep, self.etp
        )?;
        if self.fsdp > 1 {
            write!(f, ",fsdp{}", self.fsdp)?;
        }
        Ok(())
    }
}

impl InferSpec {
    pub fn new(tp: u32, dp: u32, expert_parallel: bool) -> Result<InferSpec> {
        if tp == 0 || dp == 0 {
            let key = if tp == 0 { "tp" } else { "dp" };
            return Err(Error::invalid_argument(format!(
                "inference {key} is 0; it must be at least 1"
            )));
        }
        product(&[tp, dp], "inference world tp·dp")?;
        Ok(InferSpec {
            tp,
            dp,
            expert_parallel,
        })
    }

    /// Parses `tp32,dp8`, `tp8,dp8,ep` … Keys: `tp`, `dp` (default 1) and `ep`: bare `ep`
    /// turns expert parallelism on; `epN` must be 1 (off) or `tp·dp`, the only EP size vLLM and
    /// SGLang use.
    pub fn parse(text: &str) -> Result<InferSpec> {
        let (mut tp, mut dp, mut ep) = (1, 1, None);
        for (key, value) in pairs(text, "inference")? {
            match (key, value) {
                ("tp", Some(n)) => tp = n,
                ("dp", Some(n)) => dp = n,
                ("ep", n) => ep = Some(n),
                ("tp" | "dp", None) => {
                    return Err(Error::invalid_argument(format!(
                        "inference spec {text:?}: {key} needs a size (like {key}8)"
                    )))
                }
                (other, _) => {
                    return Err(Error::invalid_argument(format!(
                        "inference spec {text:?}: unknown key {other:?}; use tp, dp, ep"
                    )))
                }
            }
        }
        let spec = InferSpec::new(tp, dp, false)
            .map_err(|e| e.context(format!("inference spec {text:?}")))?;
        let expert_parallel = match ep {
            None | Some(Some(1)) => false,
            Some(None) => true,
            Some(Some(n)) if n == spec.world() => true,
            Some(Some(n)) => {
                return Err(Error::invalid_argument(format!(
                    "inference spec {text:?}: ep {n} must be tp·dp = {} (experts spread over every inference rank) or 1",
                    spec.world()
                )))
            }
        };
        Ok(InferSpec {
            expert_parallel,
            ..spec
        })
    }

    /// The generation side of an M2N system config (`pp_size` and `cp_size` must be 1;
    /// `dp` from `num_gpus / tp_size`; `ep_size` 1 or `tp·dp`).
    pub fn from_m2n(side: &M2nSide) -> Result<InferSpec> {
        for (key, value) in [
            ("pp_size", side.pp_size),
            ("cp_size", side.cp_size),
            ("fsdp_size", side.fsdp_size),
        ] {
            if value > 1 {
                return Err(Error::invalid_argument(format!(
                    "generation.{key} is {value}; inference layouts support tp, dp and ep only"
                )));
            }
        }
        if side.tp_size == 0 || side.num_gpus == 0 || side.num_gpus % side.tp_size != 0 {
            return Err(Error::invalid_argument(format!(
                "generation.num_gpus {} is not a multiple of tp_size {}",
                side.num_gpus, side.tp_size
            )));
        }
        let dp = side.num_gpus / side.tp_size;
        if side.dp_size > 1 && side.dp_size != dp {
            return Err(Error::invalid_argument(format!(
                "generation.dp_size {} disagrees with num_gpus / tp_size = {dp}",
                side.dp_size
            )));
        }
        let expert_parallel = match side.ep_size {
            0 | 1 => false,
            n if n == side.num_gpus => true,
            n => {
                return Err(Error::invalid_argument(format!(
                    "generation.ep_size {n} must be 1 or num_gpus {}",
                    side.num_gpus
                )))
            }
        };
        InferSpec::new(side.tp_size, dp, expert_parallel).map_err(|e| e.context("generation"))
    }

    pub fn world(&self) -> u32 {
        self.tp * self.dp
    }
}

impl fmt::Display for InferSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{},dp{}", self.tp, self.dp)?;
        if self.expert_parallel {
            f.write_str(",ep")?;
        }
        Ok(())
    }
}
