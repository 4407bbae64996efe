//! The one walk of a rank's [`RankProgram`] that every transport runs (docs/design.md §4):
//! what happens when, and what a failure stops. Transports say how each step is done by
//! implementing [`Steps`]; the walk ([`run`]) is written once.
//!
//! In order, per round: its conversions (the first round's before anything else; round
//! k + 1's started beside round k, from before its packs, and joined before round k + 1's
//! packs), its packs (the local copies before the first round's, or started beside the first
//! round where `RankProgram::local_copies_beside` allows and joined at the second round's
//! start or the end), the round's exchange (its sends and receives as one group), its late
//! unpacks started beside what follows, its early unpacks; then the conversions after the
//! rounds. A round's conversions write workspace
//! regions no earlier round reads (`RoundSpan::converts_end`), so only the round's own packs
//! and sends must wait for them: [`Steps::join_converts`]. Round k's late unpacks read an arena
//! of their own (one per round parity), so they must be done before round k + 2 posts its
//! exchange (which reuses that arena) and before the conversions after the rounds;
//! [`Steps::join_late`] says so at those two points and nowhere else.
//!
//! Failures: a step that fails stops every later local step, but never an exchange. Peers wait
//! for each round's messages, so once any message may have been posted every round is still
//! exchanged (with whatever the buffers hold) and the first error is returned at the end: a
//! failed call can leave wrong bytes in the destination, never a peer waiting forever.

use crate::error::{Error, Result};
use crate::plan::{RankProgram, Round};

/// Local work of one call (copies and conversions of the rank's own memory), in the order the
/// walk asks for it. Indices count the rank's own rounds (`RankProgram::rounds`), from 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The first round's conversions (`Round::converts`), before anything else; later
    /// rounds' run between [`Steps::fork_converts`] and [`Steps::join_converts`].
    FirstConverts,
    /// `RankProgram::local_copies`, before the first round's packs (where they do not run
    /// beside the first round).
    LocalCopies,
    /// Round k's packs.
    Packs(usize),
    /// Round k's early unpacks (`Round::early_unpacks`), after its exchange.
    EarlyUnpacks(usize),
    /// `RankProgram::converts_after`, once every late unpack is done.
    ConvertsAfter,
}

/// How a transport does each step of one call of a rank's program (see the module
/// documentation for the order and the failure rule). A device transport gets the local steps
/// from the GPU runtime (`gpu::DeviceCall`) and implements only its exchange.
pub trait Steps {
    /// Runs `step`'s copies or conversions after everything asked for before.
    fn run(&mut self, step: Step) -> Result<()>;

    /// Posts round `k`'s sends and receives (`round`) as one group: together, so that the
    /// order of a pair's messages cannot deadlock.
    fn exchange(&mut self, k: usize, round: &Round<'_>) -> Result<()>;

    /// Posts one step of the senders' barrier before plan round `round.round`
    /// (`RankProgram::barrier_step`) as one group of its own, after everything asked for
    /// before: once its last step is through, every member has reached the barrier, that is,
    /// has finished its rounds before that one.
    fn barrier(&mut self, round: &Round<'_>) -> Result<()>;

    /// Starts round `k`'s conversions (`Round::converts`), beside round `k - 1`'s packs and
    /// exchange: they may run at any time from now until [`Steps::join_converts`] of `k`.
    fn fork_converts(&mut self, k: usize) -> Result<()>;

    /// Waits (in the call's order) for round `k`'s conversions, before its packs.
    fn join_converts(&mut self, k: usize) -> Result<()>;

    /// Starts the local copies beside the first round: they may run at any time from now
    /// until [`Steps::join_local`].
    fn fork_local(&mut self) -> Result<()>;

    /// Waits (in the call's order) for the local copies, at the second round's start or
    /// before the conversions after the rounds.
    fn join_local(&mut self) -> Result<()>;

    /// Starts round `k`'s late unpacks (`Round::late_unpacks`): they may run at any time from
    /// now until the next [`Steps::join_late`] of parity `k % 2`.
    fn fork_late(&mut self, k: usize) -> Result<()>;

    /// Waits (in the call's order) for the late unpacks started for rounds of `parity`.
    fn join_late(&mut self, parity: usize) -> Result<()>;
}

/// Runs `program` through `steps`. Returns the first error (see the module documentation for
/// what still runs after it).
pub fn run(program: &RankProgram, steps: &mut impl Steps) -> Result<()> {
    let mut failure: Option<Error> = None;
    let mut rounds = 0;
    // Side work forked and not yet joined: the next round's conversions, the local copies.
    let (mut converting, mut copying) = (false, false);
    let beside = program.local_copies_beside();
    let mut walk = program.rounds_iter().enumerate().peekable();
    // The next plan round whose senders' barrier is still to come: every one of
    // `1 .. barrier_rounds`, also before rounds the rank takes no part in.
    let mut barrier = 1;
    let barriers = if program.has_barrier() {
        program.barrier_rounds
    } else {
        0
    };
    while let Some((k, round)) = walk.next() {
        rounds = k + 1;
        if k == 0 {
            local(&mut failure, || steps.run(Step::FirstConverts));
            if !beside {
                local(&mut failure, || steps.run(Step::LocalCopies));
            } else if failure.is_none() {
                copying = true;
                local(&mut failure, || steps.fork_local());
            }
        } else if k == 1 && std::mem::take(&mut copying) {
            always(&mut failure, || steps.join_local());
        }
        if k > 0 && std::mem::take(&mut converting) {
            always(&mut failure, || steps.join_converts(k));
        }
        if walk
            .peek()
            .is_some_and(|(_, next)| !next.converts.is_empty())
            && failure.is_none()
        {
            converting = true;
            local(&mut failure, || steps.fork_converts(k + 1));
        }
        local(&mut failure, || steps.run(Step::Packs(k)));
        if k >= 2 {
            always(&mut failure, || steps.join_late(k % 2));
        }
        while barrier < barriers && barrier <= round.round {
            pass_barrier(program, barrier, &mut failure, steps);
            barrier += 1;
        }
        always(&mut failure, || steps.exchange(k, &round));
        if round.late > 0 {
            local(&mut failure, || steps.fork_late(k));
        }
        local(&mut failure, || steps.run(Step::EarlyUnpacks(k)));
    }
    while barrier < barriers {
        pass_barrier(program, barrier, &mut failure, steps);
        barrier += 1;
    }
    // The older pending parity first: round `rounds - 2`'s, then `rounds - 1`'s.
    for parity in [rounds % 2, (rounds + 1) % 2] {
        always(&mut failure, || steps.join_late(parity));
    }
    if copying {
        always(&mut failure, || steps.join_local());
    }
    local(&mut failure, || steps.run(Step::ConvertsAfter));
    failure.map_or(Ok(()), Err)
}

/// Every step of the senders' barrier before plan round `round`, in order (each waits for
/// the one before on the stream); after a failure too, since the other members wait for them.
fn pass_barrier(
    program: &RankProgram,
    round: u32,
    failure: &mut Option<Error>,
    steps: &mut impl Steps,
) {
    for step in 0..program.barrier_steps() {
        always(failure, || {
            steps.barrier(&program.barrier_step(round, step))
        });
    }
}

/// Runs a local step unless an earlier one failed.
fn local(failure: &mut Option<Error>, step: impl FnOnce() -> Result<()>) {
    if failure.is_none() {
        *failure = step().err();
    }
}

/// Runs a step that runs even after a failure (an exchange, a wait for side work), keeping
/// the first error.
fn always(failure: &mut Option<Error>, step: impl FnOnce() -> Result<()>) {
    if let Err(e) = step() {
        failure.get_or_insert(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::DType;
    use crate::plan::{Buffer, CopyDim, Loc, Message, RoundSpan, StridedConvert, StridedCopy};
    use crate::quant::Arithmetic;

    /// Records the walk; fails the steps it is told to.
    #[derive(Default)]
    struct Log {
        events: Vec<String>,
        fail: Vec<String>,
    }

    impl Log {
        fn note(&mut self, event: String) -> Result<()> {
            let failed = self.fail.contains(&event);
            self.events.push(event.clone());
            if failed {
                Err(Error::internal(event))
            } else {
                Ok(())
            }
        }
    }

    impl Steps for Log {
        fn run(&mut self, step: Step) -> Result<()> {
            self.note(format!("{step:?}"))
        }
        fn exchange(&mut self, k: usize, _: &Round<'_>) -> Result<()> {
            self.note(format!("Exchange({k})"))
        }
        fn barrier(&mut self, round: &Round<'_>) -> Result<()> {
            let step = round.barrier.expect("a barrier step");
            self.note(format!("Barrier({}.{step})", round.round))
        }
        fn fork_converts(&mut self, k: usize) -> Result<()> {
            self.note(format!("ForkConverts({k})"))
        }
        fn join_converts(&mut self, k: usize) -> Result<()> {
            self.note(format!("JoinConverts({k})"))
        }
        fn fork_local(&mut self) -> Result<()> {
            self.note("ForkLocal".into())
        }
        fn join_local(&mut self) -> Result<()> {
            self.note("JoinLocal".into())
        }
        fn fork_late(&mut self, k: usize) -> Result<()> {
            self.note(format!("Fork({k})"))
        }
        fn join_late(&mut self, parity: usize) -> Result<()> {
            self.note(format!("Join({parity})"))
        }
    }

    fn unpack() -> StridedCopy {
        let at = |buffer| Loc {
            buffer,
            tensor: 0,
            offset: 0,
        };
        StridedCopy::new(
            at(Buffer::Staging),
            at(Buffer::Dst),
            1,
            &[CopyDim {
                count: 1,
                src_stride: 1,
                dst_stride: 1,
            }],
        )
    }

    /// A message of `bytes` to or from rank 1, at the start of the staging arena.
    fn staged_message(bytes: u64) -> Message {
        Message {
            peer: 1,
            loc: Loc {
                buffer: Buffer::Staging,
                tensor: 0,
                offset: 0,
            },
            bytes,
        }
    }

    /// Three rounds; the first two each have one late unpack.
    fn program() -> RankProgram {
        let message = staged_message(1);
        let span = |round: u32, n: usize, late: usize| RoundSpan {
            round,
            recvs_end: n,
            unpacks_end: n,
            late_unpacks: late,
            ..Default::default()
        };
        RankProgram {
            recvs: vec![message; 3],
            unpacks: vec![unpack(); 3],
            round_spans: vec![span(0, 1, 1), span(1, 2, 1), span(4, 3, 0)],
            ..Default::default()
        }
    }

    #[test]
    fn late_unpacks_are_joined_before_their_arena_is_reused_and_at_the_end() {
        let mut log = Log::default();
        run(&program(), &mut log).unwrap();
        assert_eq!(
            log.events.join(" "),
            "FirstConverts LocalCopies Packs(0) Exchange(0) Fork(0) EarlyUnpacks(0) \
             Packs(1) Exchange(1) Fork(1) EarlyUnpacks(1) \
             Packs(2) Join(0) Exchange(2) EarlyUnpacks(2) \
             Join(1) Join(0) ConvertsAfter"
        );
    }

    /// [`program`] with conversions first read by its first and third rounds.
    fn converting() -> RankProgram {
        let convert = StridedConvert {
            tensor: 0,
            start: vec![0],
            src: Loc {
                buffer: Buffer::Src,
                tensor: 0,
                offset: 0,
            },
            dst: Loc {
                buffer: Buffer::Work,
                tensor: 0,
                offset: 0,
            },
            scale: None,
            dims: Vec::new(),
            arithmetic: Arithmetic {
                src: DType::Bfloat16,
                dst: DType::Float8E4M3,
                scale: None,
            },
        };
        let mut p = program();
        p.converts_before = vec![convert; 3];
        for (span, end) in p.round_spans.iter_mut().zip([1, 1, 3]) {
            span.converts_end = end;
        }
        assert!(p.rounds_are_consistent() && p.has_side_work());
        p
    }

    #[test]
    fn a_rounds_conversions_run_beside_the_round_before_and_are_joined_before_its_packs() {
        let mut log = Log::default();
        run(&converting(), &mut log).unwrap();
        assert_eq!(
            log.events.join(" "),
            "FirstConverts LocalCopies Packs(0) Exchange(0) Fork(0) EarlyUnpacks(0) \
             ForkConverts(2) Packs(1) Exchange(1) Fork(1) EarlyUnpacks(1) \
             JoinConverts(2) Packs(2) Join(0) Exchange(2) EarlyUnpacks(2) \
             Join(1) Join(0) ConvertsAfter"
        );
        // Forked conversions are joined even after a failure (the side stream must be done
        // with them before the call ends), and nothing local runs after it.
        let mut log = Log {
            fail: vec!["Packs(1)".into()],
            ..Default::default()
        };
        assert_eq!(
            run(&converting(), &mut log).unwrap_err().message,
            "Packs(1)"
        );
        assert_eq!(
            log.events.join(" "),
            "FirstConverts LocalCopies Packs(0) Exchange(0) Fork(0) EarlyUnpacks(0) \
             ForkConverts(2) Packs(1) Exchange(1) \
             JoinConverts(2) Join(0) Exchange(2) \
             Join(1) Join(0)"
        );
    }

    #[test]
    fn local_copies_run_beside_the_first_round_and_are_joined_at_the_second_or_the_end() {
        let copy = StridedCopy::new(
            Loc {
                buffer: Buffer::Src,
                tensor: 0,
                offset: 0,
            },
            Loc {
                buffer: Buffer::Dst,
                tensor: 0,
                offset: 8,
            },
            1,
            &[CopyDim {
                count: 1,
                src_stride: 1,
                dst_stride: 1,
            }],
        );
        let mut p = converting();
        p.local_copies = vec![copy];
        assert!(p.local_copies_beside());
        let mut log = Log::default();
        run(&p, &mut log).unwrap();
        assert_eq!(
            log.events.join(" "),
            "FirstConverts ForkLocal Packs(0) Exchange(0) Fork(0) EarlyUnpacks(0) \
             JoinLocal ForkConverts(2) Packs(1) Exchange(1) Fork(1) EarlyUnpacks(1) \
             JoinConverts(2) Packs(2) Join(0) Exchange(2) EarlyUnpacks(2) \
             Join(1) Join(0) ConvertsAfter"
        );
        // One round: joined before the conversions after it.
        p.round_spans.clear();
        p.converts_before.clear();
        assert!(p.local_copies_beside());
        let mut log = Log::default();
        run(&p, &mut log).unwrap();
        assert_eq!(
            log.events.join(" "),
            "FirstConverts ForkLocal Packs(0) Exchange(0) EarlyUnpacks(0) \
             Join(1) Join(0) JoinLocal ConvertsAfter"
        );
        // A first round that sends from a destination view keeps them before its packs.
        p.sends = vec![Message {
            peer: 1,
            loc: Loc {
                buffer: Buffer::Dst,
                tensor: 0,
                offset: 8,
            },
            bytes: 1,
        }];
        assert!(!p.local_copies_beside());
        let mut log = Log::default();
        run(&p, &mut log).unwrap();
        assert!(log
            .events
            .join(" ")
            .starts_with("FirstConverts LocalCopies Packs(0)"));
    }

    #[test]
    fn the_senders_barrier_comes_before_every_plan_round_from_the_second_even_after_a_failure() {
        // A sender in plan rounds 0, 2 and 3 of 6: barriers before 1 and 2 (it skips round 1),
        // before 3, then 4 and 5 after its last round.
        let message = staged_message(8);
        let span = |round: u32, n: usize| RoundSpan {
            round,
            sends_end: n,
            ..Default::default()
        };
        let p = RankProgram {
            sends: vec![message; 3],
            round_spans: vec![span(0, 1), span(2, 2), span(3, 3)],
            // Two steps (three or four members).
            barrier_rounds: 6,
            barrier_sends: vec![message; 2],
            barrier_recvs: vec![message; 2],
            ..Default::default()
        };
        assert_eq!(p.mode(), crate::plan::ExecMode::Staged);
        let mut log = Log::default();
        run(&p, &mut log).unwrap();
        assert_eq!(
            log.events.join(" "),
            "FirstConverts LocalCopies Packs(0) Exchange(0) EarlyUnpacks(0) \
             Packs(1) Barrier(1.0) Barrier(1.1) Barrier(2.0) Barrier(2.1) Exchange(1) \
             EarlyUnpacks(1) Packs(2) Join(0) Barrier(3.0) Barrier(3.1) Exchange(2) \
             EarlyUnpacks(2) Barrier(4.0) Barrier(4.1) Barrier(5.0) Barrier(5.1) \
             Join(1) Join(0) ConvertsAfter"
        );
        // Mates wait for every barrier: a failure stops local steps, never a barrier.
        let mut log = Log {
            fail: vec!["Packs(1)".into()],
            ..Default::default()
        };
        assert_eq!(run(&p, &mut log).unwrap_err().message, "Packs(1)");
        assert_eq!(
            log.events.join(" "),
            "FirstConverts LocalCopies Packs(0) Exchange(0) EarlyUnpacks(0) \
             Packs(1) Barrier(1.0) Barrier(1.1) Barrier(2.0) Barrier(2.1) Exchange(1) \
             Join(0) Barrier(3.0) Barrier(3.1) Exchange(2) Barrier(4.0) Barrier(4.1) \
             Barrier(5.0) Barrier(5.1) Join(1) Join(0)"
        );
        // One plan round: no barrier at all.
        let mut one = p.clone();
        one.barrier_rounds = 1;
        one.round_spans.clear();
        let mut log = Log::default();
        run(&one, &mut log).unwrap();
        assert!(!log.events.join(" ").contains("Barrier"));
    }

    #[test]
    fn a_failure_stops_local_steps_but_every_round_is_still_exchanged() {
        let mut log = Log {
            fail: vec!["Packs(1)".into()],
            ..Default::default()
        };
        let e = run(&program(), &mut log).unwrap_err();
        assert_eq!(e.message, "Packs(1)");
        assert_eq!(
            log.events.join(" "),
            "FirstConverts LocalCopies Packs(0) Exchange(0) Fork(0) EarlyUnpacks(0) \
             Packs(1) Exchange(1) \
             Join(0) Exchange(2) \
             Join(1) Join(0)"
        );
        // A failed exchange is reported after the rest has run.
        let mut log = Log {
            fail: vec!["Exchange(0)".into()],
            ..Default::default()
        };
        assert_eq!(
            run(&program(), &mut log).unwrap_err().message,
            "Exchange(0)"
        );
        assert!(log
            .events
            .ends_with(&["Exchange(2)".into(), "Join(1)".into(), "Join(0)".into()]));
    }
}
