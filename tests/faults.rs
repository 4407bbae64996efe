//! Calls with a deadline under injected faults, on 8 emulated GPUs (docs/resilience.md): a rank
//! that dies before a call or in the middle of a round's group, a rank that is slow (below or
//! above the deadline), a broken link. Every survivor's call must end by its deadline plus the
//! bound the library states; the survivors then shrink the communicator, plan for themselves and
//! call again, and every surviving destination byte is checked; or, when no survivor holds some
//! region, every survivor gets the same refusal. A slow rank within the deadline must not be
//! declared dead.
//!
//! One scenario per process (`fault_scenario`, ignored by default): `scripts/fault-campaign.sh`
//! runs many with `FAULT_SEED` and `FAULT_SCENARIO` set and counts the outcomes from the one line
//! each prints (`fault-scenario: … => recovered | refused | wrong | hung`); a process that
//! crashes or is killed for running too long prints none.

mod gpu_common;

use gpu_common::*;
use ncclreshard::exec::Plan;
use ncclreshard::transport::nccl::{self as transport, NcclTransport};
use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, TensorSpec, Topology};
use std::ffi::c_int;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

/// What the library states: a call with a deadline ends (fails) by its deadline plus this,
/// here on the emulator of a 2-core machine (the watchdog's tick and the revoke take a few
/// milliseconds on a GPU host; the rest is the emulator's scheduling).
const BOUND: Duration = Duration::from_millis(1500);

/// A deterministic stream of numbers from a seed (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// The victims never make the call.
    StopBefore,
    /// The victims die after this many of their NCCL operations of the call.
    StopAfter(i32),
    /// Each NCCL group of the victims starts this many milliseconds late (a call has at most
    /// five: below the deadline, or above it).
    Slow(i32),
    /// The link between the first victim and a peer of it breaks (the victim is then the one
    /// the survivors exclude).
    BrokenLink,
}

struct Scenario {
    name: String,
    tensors: Vec<TensorSpec>,
    config: Config,
    blocking: bool,
    fault: Fault,
    victims: Vec<u32>,
    /// The peer of a broken link.
    peer: u32,
    deadline_ms: u64,
}

fn mesh(shape: &[u64], ranks: &[u32]) -> Mesh {
    Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap()
}

fn layout(m: Mesh, placements: &[Placement]) -> Layout {
    Layout::new(m, placements.to_vec())
}

/// A random refit on 8 ranks: trainers on 0-3 and inference on 4-7, or both on all eight,
/// with and without replicas, every mode, one to three rounds, relays, one to three tensors.
fn scenario(seed: u64, index: u64) -> Scenario {
    let mut rng = Rng(seed ^ index.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let family = rng.below(4);
    let ntensors = 1 + rng.below(3) as usize;
    let mut tensors = Vec::new();
    for t in 0..ntensors {
        let rows = 8 * (1 + rng.below(8));
        let cols = 4 * (1 + rng.below(6));
        let dtype = rng.pick(&[DType::Float32, DType::Bfloat16, DType::Int8]);
        let (src, dst) = match family {
            // DP2 × TP2 trainers → TP2 × DP2 inference: replicas on both sides.
            0 => (
                layout(mesh(&[2, 2], &[0, 1, 2, 3]), &[r, s(0)]),
                layout(mesh(&[2, 2], &[4, 5, 6, 7]), &[r, s(1)]),
            ),
            // TP4 trainers (no replicas) → DP2 × TP2 inference.
            1 => (
                layout(mesh(&[4], &[0, 1, 2, 3]), &[s(t % 2)]),
                layout(mesh(&[2, 2], &[4, 5, 6, 7]), &[r, s(0)]),
            ),
            // Colocated: DP2 × TP4 trainers on all eight → TP2 × DP4 inference on all eight.
            2 => (
                layout(mesh(&[2, 4], &[0, 1, 2, 3, 4, 5, 6, 7]), &[r, s(0)]),
                layout(mesh(&[4, 2], &[7, 6, 5, 4, 3, 2, 1, 0]), &[r, s(1)]),
            ),
            // DP4 trainers (full replicas) → TP4 inference on 4-7.
            _ => (
                layout(mesh(&[4], &[0, 1, 2, 3]), &[r]),
                layout(mesh(&[4], &[4, 5, 6, 7]), &[s(0)]),
            ),
        };
        tensors.push(TensorSpec {
            shape: vec![rows, cols],
            dtype,
            src,
            dst,
        });
    }
    let mode = rng.pick(&[Mode::Auto, Mode::Auto, Mode::Staged, Mode::Groupable]);
    let config = Config {
        mode,
        topology: if rng.below(2) == 0 {
            Topology::Unknown
        } else {
            Topology::RanksPerNode(4)
        },
        rounds: if mode == Mode::Groupable {
            0
        } else {
            rng.pick(&[0, 2, 3])
        },
        split_min_bytes: 16,
        relay: rng.below(4) != 0,
        ..Config::default()
    };
    let deadline_ms = 3000;
    let fault = match rng.below(6) {
        0 => Fault::StopBefore,
        1 | 2 => Fault::StopAfter(1 + rng.below(8) as i32),
        3 => Fault::Slow(100 + rng.below(200) as i32),
        4 => Fault::Slow(2 * deadline_ms as i32 + rng.below(1000) as i32),
        _ => Fault::BrokenLink,
    };
    let trainers: Vec<u32> = (0..4).collect();
    let inference: Vec<u32> = (4..8).collect();
    let side = if rng.below(2) == 0 {
        &trainers
    } else {
        &inference
    };
    let mut victims = vec![rng.pick(side)];
    if rng.below(3) == 0 && fault != Fault::BrokenLink {
        let (a, b) = (rng.pick(&trainers), rng.pick(&inference));
        let other = rng.pick(&[a, b]);
        if other != victims[0] {
            victims.push(other);
        }
    }
    victims.sort_unstable();
    let peer = (victims[0] + 1 + rng.below(7) as u32) % 8;
    // Half the scenarios pass the senders' barrier among the trainers of node 0, with the
    // topology and the rounds it needs (drawn last: the draws above stay those of earlier
    // campaigns).
    let mut config = config;
    if rng.below(2) == 0 {
        config.sender_barrier = Some(true);
        config.topology = Topology::RanksPerNode(4);
        if mode != Mode::Groupable {
            config.rounds = config.rounds.max(2);
        }
    }
    Scenario {
        name: format!(
            "seed {seed} #{index}: family {family}, {ntensors} tensor(s), {mode:?}, rounds {}, relay {}, {:?}, senders' barrier {:?}, {} communicator, {fault:?} on ranks {victims:?}{}",
            config.rounds,
            config.relay,
            config.topology,
            config.sender_barrier,
            if index % 3 == 2 { "nonblocking" } else { "blocking" },
            if fault == Fault::BrokenLink { format!(" (link to {peer})") } else { String::new() }
        ),
        tensors,
        config,
        blocking: index % 3 != 2,
        fault,
        victims,
        peer,
        deadline_ms,
    }
}

/// A rank's plan with a deadline, for the communicator numbering it plans in.
fn transport_for(plan: &Plan, deadline_ms: u64) -> NcclTransport {
    NcclTransport::for_plan(plan).with_deadline(Some(deadline_ms))
}

/// What one rank saw.
#[derive(Debug, Default)]
struct Outcome {
    /// The fault step's call failed on this rank (its wait or the call itself).
    failed: bool,
    /// Waiting for the fault step's outcome took this long after the call.
    waited: Duration,
    error: String,
    /// The recovery: refused (the message), or the elements checked.
    refused: Option<String>,
    checked: u64,
    wrong: Option<String>,
}

fn run(s: &Scenario) -> &'static str {
    let n = world();
    assert_eq!(n, 8, "the fault scenarios need 8 devices");
    let id = unique_id();
    let ready = Barrier::new(n);
    let survivors_done = Barrier::new(n);
    let failures = Mutex::new(Vec::<u32>::new());
    let decided = Barrier::new(n);
    let stop: Option<unsafe extern "C" fn(Comm, c_int) -> c_int> =
        emu_control("ncclreshardEmuStopRank");
    let delay: Option<unsafe extern "C" fn(Comm, c_int) -> c_int> =
        emu_control("ncclreshardEmuDelayRank");
    let link: Option<unsafe extern "C" fn(Comm, c_int) -> c_int> =
        emu_control("ncclreshardEmuBreakLink");
    let (Some(stop), Some(delay), Some(link)) = (stop, delay, link) else {
        println!("fault-scenario: {} => skipped (needs the emulator)", s.name);
        return "skipped";
    };
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n as u32)
            .map(|r| {
                let (ready, survivors_done, failures, decided) =
                    (&ready, &survivors_done, &failures, &decided);
                scope.spawn(move || {
                    let device = Device::new(r as usize);
                    let comm = join(id, n, r as usize, s.blocking);
                    let victim = s.victims.contains(&r);
                    let mut out = Outcome::default();
                    // A warm-up call without a deadline (each rank loads the copy kernel on its
                    // first call, and on the emulator they arrive seconds apart; a deadline
                    // counts waiting for peers), then a healthy call with the deadline:
                    // byte-exact, no false alarm.
                    let plan = plan_of(&s.tensors, r, &s.config).unwrap();
                    let call = transport_for(&plan, s.deadline_ms);
                    let data = prepare(&device, &s.tensors, r);
                    ready.wait();
                    NcclTransport::for_plan(&plan)
                        .execute(&data.buffers(), comm, device.stream.cast())
                        .unwrap_or_else(|e| panic!("rank {r}: warm-up call: {e}"));
                    device.sync();
                    ready.wait();
                    call.execute(&data.buffers(), comm, device.stream.cast())
                        .unwrap_or_else(|e| panic!("rank {r}: healthy call: {e}"));
                    transport::comm_wait(comm)
                        .unwrap_or_else(|e| panic!("rank {r}: healthy call, false alarm: {e}"));
                    device.sync();
                    out.checked += data.verify(&device, &s.tensors, r);
                    // The faulty call.
                    let fresh = prepare_salted(&device, &s.tensors, r, 3);
                    if victim {
                        // SAFETY: the emulator's controls on our communicator.
                        unsafe {
                            match s.fault {
                                Fault::StopBefore => {
                                    stop(comm, 0);
                                }
                                Fault::StopAfter(k) => {
                                    stop(comm, k);
                                }
                                Fault::Slow(ms) => {
                                    delay(comm, ms);
                                }
                                Fault::BrokenLink => {
                                    link(comm, s.peer as c_int);
                                }
                            }
                        }
                    }
                    ready.wait();
                    let started = Instant::now();
                    let called = if victim && s.fault == Fault::StopBefore {
                        Ok(())
                    } else {
                        call.execute(&fresh.buffers(), comm, device.stream.cast())
                    };
                    let waited = called.and_then(|()| transport::comm_wait(comm));
                    out.waited = started.elapsed();
                    if let Err(e) = waited {
                        out.failed = true;
                        out.error = e.message;
                        failures.lock().unwrap().push(r);
                    }
                    // Whatever happened, the stream is not blocked.
                    if !victim {
                        device.sync();
                    }
                    // The survivors learn who failed (the application's job: here the fault
                    // injected, or nothing when every call completed).
                    decided.wait();
                    let any_failed = !failures.lock().unwrap().is_empty();
                    if !any_failed {
                        if !victim || !matches!(s.fault, Fault::StopBefore | Fault::StopAfter(_)) {
                            out.checked += fresh.verify(&device, &s.tensors, r);
                        }
                    } else if !victim {
                        // Shrink, plan for the survivors, call again.
                        let below = s.victims.iter().filter(|&&v| v < r).count() as u32;
                        let new = r - below;
                        // SAFETY: our communicator, shrunk by every survivor with one list.
                        let shrunk = unsafe {
                            transport::comm_shrink(
                                comm,
                                &s.victims.iter().map(|&v| v as i32).collect::<Vec<_>>(),
                                std::ptr::null_mut(),
                                true,
                            )
                        }
                        .unwrap_or_else(|e| panic!("rank {r}: shrink: {e}"));
                        match survivors_plan(&s.tensors, &s.config, &s.victims, new) {
                            Err(e) => out.refused = Some(e.message),
                            Ok(plan) => {
                                let (specs, _, _) = ncclreshard::plan::survivors(
                                    &s.tensors,
                                    &vec![None; s.tensors.len()],
                                    &s.config,
                                    &s.victims,
                                )
                                .unwrap();
                                let again = prepare_salted(&device, &specs, new, 5);
                                let call = transport_for(&plan, s.deadline_ms);
                                let result = call
                                    .execute(&again.buffers(), shrunk, device.stream.cast())
                                    .and_then(|()| transport::comm_wait(shrunk));
                                device.sync();
                                match result {
                                    Err(e) => {
                                        out.wrong = Some(format!("the survivors' call failed: {e}"))
                                    }
                                    Ok(()) => {
                                        let verified =
                                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                                                || again.verify(&device, &specs, new),
                                            ));
                                        match verified {
                                            Ok(k) => out.checked += k,
                                            Err(_) => {
                                                out.wrong =
                                                    Some("wrong bytes after recovery".into())
                                            }
                                        }
                                    }
                                }
                                again.free(&device);
                            }
                        }
                        // SAFETY: communicators of ours, not used again.
                        unsafe {
                            let destroyed = (nccl().destroy)(shrunk);
                            settle(shrunk, destroyed, "ncclCommDestroy (shrunk)");
                            (nccl().destroy)(comm);
                        }
                    }
                    survivors_done.wait();
                    if any_failed && victim {
                        // The dead rank's state goes (its process would be gone).
                        // SAFETY: our communicator.
                        unsafe { (nccl().abort)(comm) };
                        device.sync();
                    } else if !any_failed {
                        device.sync();
                        // SAFETY: our communicator.
                        unsafe {
                            let destroyed = (nccl().destroy)(comm);
                            settle(comm, destroyed, "ncclCommDestroy");
                        }
                    }
                    data.free(&device);
                    fresh.free(&device);
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    // Judge the scenario.
    let deadline = Duration::from_millis(s.deadline_ms);
    let survivors: Vec<(u32, &Outcome)> = outcomes
        .iter()
        .enumerate()
        .filter(|(r, _)| !s.victims.contains(&(*r as u32)))
        .map(|(r, o)| (r as u32, o))
        .collect();
    let worst = survivors
        .iter()
        .map(|(_, o)| o.waited)
        .max()
        .unwrap_or_default();
    let any_failed = outcomes.iter().any(|o| o.failed);
    let verdict = |v: &str, detail: String| -> &'static str {
        println!(
            "fault-scenario: {} => {v} ({detail}; slowest survivor's call ended after {} ms, deadline {} ms + bound {} ms)",
            s.name,
            worst.as_millis(),
            s.deadline_ms,
            BOUND.as_millis()
        );
        match v {
            "recovered" => "recovered",
            "refused" => "refused",
            "hung" => "hung",
            _ => "wrong",
        }
    };
    if worst > deadline + deadline + BOUND {
        return verdict("hung", "a survivor waited far past its deadline".into());
    }
    let slow_below = matches!(s.fault, Fault::Slow(ms) if (ms as u64) < s.deadline_ms / 2);
    if slow_below && any_failed {
        let first = outcomes.iter().find(|o| o.failed).map(|o| o.error.clone());
        return verdict(
            "wrong",
            format!("a rank slow within the deadline was declared dead: {first:?}"),
        );
    }
    if !any_failed {
        // A rank with no peers may skip a call; one with peers is waited for.
        let absent_with_peers = s.fault == Fault::StopBefore
            && s.victims.iter().any(|&v| {
                !plan_of(&s.tensors, v, &s.config)
                    .unwrap()
                    .program()
                    .peers()
                    .is_empty()
            });
        if absent_with_peers {
            return verdict(
                "wrong",
                "a rank with peers never called, yet every call completed".into(),
            );
        }
        return verdict(
            "recovered",
            "no call failed (the fault touched no peer's call)".into(),
        );
    }
    if survivors
        .iter()
        .any(|(_, o)| o.failed && o.waited > deadline + BOUND)
    {
        return verdict(
            "wrong",
            "a failing call ended later than its deadline plus the bound".into(),
        );
    }
    if let Some((r, o)) = survivors.iter().find(|(_, o)| o.wrong.is_some()) {
        return verdict("wrong", format!("rank {r}: {}", o.wrong.as_ref().unwrap()));
    }
    let refusals: Vec<&String> = survivors
        .iter()
        .filter_map(|(_, o)| o.refused.as_ref())
        .collect();
    if !refusals.is_empty() {
        if refusals.len() != survivors.len() || refusals.iter().any(|m| *m != refusals[0]) {
            return verdict(
                "wrong",
                "the survivors did not all get the same refusal".into(),
            );
        }
        return verdict("refused", refusals[0].clone());
    }
    let first = outcomes
        .iter()
        .find(|o| o.failed)
        .map(|o| o.error.clone())
        .unwrap_or_default();
    let checked: u64 = outcomes.iter().map(|o| o.checked).sum();
    verdict(
        "recovered",
        format!("{checked} elements checked; the first failure said: {first}"),
    )
}

#[test]
#[ignore = "needs the emulator (or 8 GPUs): scripts/fault-campaign.sh"]
fn fault_scenario() {
    let seed = std::env::var("FAULT_SEED").map_or(1, |v| v.parse().expect("FAULT_SEED"));
    let index = std::env::var("FAULT_SCENARIO").map_or(0, |v| v.parse().expect("FAULT_SCENARIO"));
    let s = scenario(seed, index);
    let verdict = run(&s);
    assert!(
        matches!(verdict, "recovered" | "refused" | "skipped"),
        "{verdict}"
    );
}
