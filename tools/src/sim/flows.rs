//! Max-min fair sharing of links by flows, event driven.
//!
//! Each flow crosses at most [`MAX_LINKS`] links (GPU egress and ingress, NVLink hops of PXN
//! routing, leaf uplinks and downlinks, a per-peer cap). Between events every link's capacity is shared max-min fairly
//! among the active flows crossing it (progressive filling: the most constrained link fixes the
//! rate of its flows, which then leave the problem); an event is flows becoming active or
//! finishing, after which rates are recomputed.
//!
//! Events close together are merged into one recomputation: flows finishing inside the
//! merged window finish at their exact times but release their capacity only at the window's
//! end, and flows starting inside it start at its end. Each leaves capacity idle while it
//! waits (a finishing flow its rate, a start the share it would get beside the flows already
//! on its links), so a window lasts only while that idle capacity stays within
//! [`IDLE_FRACTION`] of the window's time on the links that carry flows, and at most
//! [`MAX_WINDOW`] of the clock. It errs on the slow side: against fixed windows of 10⁻⁶ of the
//! clock (converged), DeepSeek-V3 `pp16,ep16 → tp32,dp8` (`simulate --trials 0`) comes out
//! 0.03 % slow (0.93542 s against 0.93515 s), Qwen3-32B `tp4,pp4,dp2 → tp1,dp16` 0.08 %.
//! Until 0.16.1 every window was [`MAX_WINDOW`] of the clock, which a second into a refit
//! merged finishes up to a millisecond apart and left links idle for much of that at every
//! round's end: that refit took 0.959 s against 0.935 s, Kimi-K2 per-expert 2.953 s against
//! 2.845 s (docs/simulator.md §2).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Links one flow may cross.
pub(crate) const MAX_LINKS: usize = 5;

/// The most of a merged window's time the links with flows may idle for the merging, on
/// average.
const IDLE_FRACTION: f64 = 1e-3;

/// The longest window, relative to the simulated clock (or to the makespan floor early on),
/// whatever [`IDLE_FRACTION`] allows (flows that move nothing leave nothing idle).
const MAX_WINDOW: f64 = 1e-3;

/// One transfer: `bytes` over `links`; a `capped` flow never moves faster than the run's
/// per-flow cap. When it starts is the caller's to say ([`run_gated`]).
#[derive(Clone, Debug)]
pub(crate) struct Flow {
    pub links: [u32; MAX_LINKS],
    pub nlinks: u8,
    pub capped: bool,
    pub bytes: f64,
}

impl Flow {
    fn links(&self) -> &[u32] {
        &self.links[..self.nlinks as usize]
    }
}

/// What happened: the bytes that crossed each link.
pub(crate) struct Outcome {
    pub link_bytes: Vec<f64>,
}

/// Called when a flow finishes: (flow, time, releases to add).
pub(crate) type OnFinish<'a> = dyn FnMut(u32, f64, &mut Vec<(u32, f64)>) + 'a;

/// Runs `flows` over links of the given capacities (bytes per second), capped flows at most
/// `cap` bytes per second, until every released flow is done. A flow starts only once
/// released: `initial` releases some (flow, start time) pairs; when a flow finishes,
/// `on_finish(flow, time, release)` may release more, each at a start time no earlier than
/// `time`. A flow never released never finishes.
pub(crate) fn run_gated(
    flows: &[Flow],
    capacity: &[f64],
    cap: f64,
    initial: Vec<(u32, f64)>,
    on_finish: &mut OnFinish<'_>,
) -> Outcome {
    let n = flows.len();
    let mut finish = vec![f64::INFINITY; n];
    // Every byte of a flow crosses each of its links, whatever the timing.
    let mut link_bytes = vec![0.0; capacity.len()];
    for f in flows {
        for &l in f.links() {
            link_bytes[l as usize] += f.bytes;
        }
    }
    // The makespan cannot be shorter than the busiest link's bytes over its capacity.
    let floor = link_bytes
        .iter()
        .zip(capacity)
        .map(|(&b, &c)| b / c)
        .filter(|t| t.is_finite())
        .fold(0.0, f64::max);

    // Per flow: the capacity of its tightest link (or its cap), what its rate is a fraction of.
    let tightest: Vec<f64> = flows
        .iter()
        .map(|f| {
            let own = if f.capped { cap } else { f64::INFINITY };
            f.links()
                .iter()
                .map(|&l| capacity[l as usize])
                .fold(own, f64::min)
        })
        .collect();
    // Finishes and starts that may join the next event (time, fraction of a link).
    let mut waiting: Vec<(f64, f64)> = Vec::new();
    // Per flow: bytes left at time `since`, moving at `rate` since then, done at `done_at`.
    let mut remaining: Vec<f64> = flows.iter().map(|f| f.bytes).collect();
    let mut since = vec![0.0; n];
    let mut rate = vec![0.0; n];
    let mut new_rate = vec![0.0; n];
    let mut done_at = vec![f64::INFINITY; n];

    // Released flows by start time (non-negative floats order like their bits).
    let mut pending: BinaryHeap<Reverse<(u64, u32)>> = initial
        .into_iter()
        .map(|(f, start)| Reverse((start.max(0.0).to_bits(), f)))
        .collect();
    let mut released: Vec<(u32, f64)> = Vec::new();
    let mut active: Vec<u32> = Vec::new();
    let mut filler = Filler::new(capacity.len(), n);
    let mut now = 0.0f64;
    let mut first_done = f64::INFINITY;

    loop {
        let first_start = pending.peek().map_or(f64::INFINITY, |Reverse((start, _))| {
            f64::from_bits(*start).max(now)
        });
        let first = first_done.min(first_start);
        if !first.is_finite() {
            // Nothing pending, or active flows that cannot move (a zero-capacity link).
            for &f in &active {
                finish[f as usize] = f64::INFINITY;
            }
            break;
        }
        // The event happens at the last completion or start inside the window.
        let finishes = active.iter().map(|&f| {
            let f = f as usize;
            (done_at[f], fraction(rate[f], tightest[f]))
        });
        let longest = first + MAX_WINDOW * now.max(floor);
        // A start's share: what it would get beside the flows already on its links (only for
        // the starts the window could reach).
        let starts = pending
            .iter()
            .map(|&Reverse((start, f))| (f64::from_bits(start).max(now), f as usize))
            .filter(|&(start, _)| start <= longest)
            .map(|(start, f)| {
                let rate = flows[f]
                    .links()
                    .iter()
                    .map(|&l| capacity[l as usize] / (filler.on(l) + 1) as f64)
                    .fold(tightest[f], f64::min);
                (start, fraction(rate, tightest[f]))
            });
        let horizon = merge_horizon(
            first,
            longest,
            IDLE_FRACTION * filler.busy.len() as f64,
            finishes.chain(starts),
            &mut waiting,
        );
        let mut at = first;
        let mut done: Vec<u32> = Vec::new();
        active.retain(|&f| {
            let fi = f as usize;
            if done_at[fi] <= horizon {
                filler.remove(flows, f);
                finish[fi] = done_at[fi];
                at = at.max(done_at[fi]);
                done.push(f);
                false
            } else {
                true
            }
        });
        loop {
            for f in done.drain(..) {
                on_finish(f, finish[f as usize], &mut released);
                for (g, start) in released.drain(..) {
                    let start = start.max(finish[f as usize]);
                    pending.push(Reverse((start.to_bits(), g)));
                }
            }
            let Some(&Reverse((start, f))) = pending.peek() else {
                break;
            };
            let start = f64::from_bits(start);
            if start > horizon {
                break;
            }
            pending.pop();
            let fi = f as usize;
            if remaining[fi] > 0.0 {
                at = at.max(start);
                active.push(f);
                filler.add(flows, f);
            } else {
                // Nothing to move: done when it starts, which may release others.
                finish[fi] = start.max(now);
                done.push(f);
            }
        }
        now = at;
        if active.is_empty() {
            first_done = f64::INFINITY;
            continue;
        }
        filler.fill(flows, &active, capacity, cap, &mut new_rate);
        first_done = f64::INFINITY;
        for &f in &active {
            let f = f as usize;
            remaining[f] = (remaining[f] - rate[f] * (now - since[f])).max(0.0);
            since[f] = now;
            rate[f] = new_rate[f];
            done_at[f] = if rate[f] > 0.0 {
                now + remaining[f] / rate[f]
            } else {
                f64::INFINITY
            };
            first_done = first_done.min(done_at[f]);
        }
    }
    Outcome { link_bytes }
}

/// `rate` as a fraction of `capacity` (0 for a flow no link or cap limits).
fn fraction(rate: f64, capacity: f64) -> f64 {
    if capacity.is_finite() {
        rate / capacity
    } else {
        0.0
    }
}

/// The end of the window merged into the event at `first` (the earliest of `items`): the
/// latest candidate time up to `longest` at which the capacity the window has left idle is
/// at most `allowed` link-seconds per second of the window. `items` are the candidates, each
/// a time and a fraction of a link: a finishing flow leaves its rate (as a fraction of its
/// tightest link) idle from its finish to the event, a start that waits for the event what
/// it would take.
fn merge_horizon(
    first: f64,
    longest: f64,
    allowed: f64,
    items: impl Iterator<Item = (f64, f64)>,
    scratch: &mut Vec<(f64, f64)>,
) -> f64 {
    scratch.clear();
    scratch.extend(items.filter(|&(t, _)| t <= longest));
    // Idle link-seconds if the window ended at each candidate in turn: those before it, each
    // idle from its own time. Candidates are put in order a batch at a time (the window
    // usually ends within the first).
    const BATCH: usize = 64;
    let by_time = |a: &(f64, f64), b: &(f64, f64)| a.0.total_cmp(&b.0);
    let (mut idle, mut weight, mut end) = (0.0, 0.0, first);
    let mut rest = &mut scratch[..];
    while !rest.is_empty() {
        let k = BATCH.min(rest.len());
        if k < rest.len() {
            rest.select_nth_unstable_by(k - 1, by_time);
        }
        let (batch, after) = rest.split_at_mut(k);
        batch.sort_unstable_by(by_time);
        for &(t, fraction) in batch.iter() {
            idle += (t - end) * weight;
            if idle > allowed * (t - first) {
                return end;
            }
            weight += fraction;
            end = t;
        }
        rest = after;
    }
    end
}

/// Progressive filling over the active flows, whose membership of each link it keeps as they
/// start and finish (so an event costs the flows' links once, not a rebuilt table).
struct Filler {
    /// Active flows crossing each link.
    members: Vec<Vec<u32>>,
    /// Per flow: its position in each of its links' `members`.
    slot: Vec<[u32; MAX_LINKS]>,
    /// Links with active flows (in no order) and each link's position there (`u32::MAX`: none).
    busy: Vec<u32>,
    busy_at: Vec<u32>,
    /// Flows on each link whose rate is not fixed yet.
    unfixed: Vec<u32>,
    /// Capacity not yet given to fixed flows.
    left: Vec<f64>,
    /// Per flow: the fill that fixed its rate (`epoch` is the current one).
    fixed: Vec<u32>,
    epoch: u32,
}

impl Filler {
    fn new(links: usize, flows: usize) -> Filler {
        Filler {
            members: vec![Vec::new(); links],
            slot: vec![[0; MAX_LINKS]; flows],
            busy: Vec::new(),
            busy_at: vec![u32::MAX; links],
            unfixed: vec![0; links],
            left: vec![0.0; links],
            fixed: vec![0; flows],
            epoch: 0,
        }
    }

    /// Active flows crossing link `l`.
    fn on(&self, l: u32) -> usize {
        self.members[l as usize].len()
    }

    /// Flow `f` starts.
    fn add(&mut self, flows: &[Flow], f: u32) {
        for (k, &l) in flows[f as usize].links().iter().enumerate() {
            let li = l as usize;
            if self.members[li].is_empty() {
                self.busy_at[li] = self.busy.len() as u32;
                self.busy.push(l);
            }
            self.slot[f as usize][k] = self.members[li].len() as u32;
            self.members[li].push(f);
        }
    }

    /// Flow `f` finishes.
    fn remove(&mut self, flows: &[Flow], f: u32) {
        for (k, &l) in flows[f as usize].links().iter().enumerate() {
            let li = l as usize;
            let at = self.slot[f as usize][k] as usize;
            let last = self.members[li].pop().expect("a flow is on its links");
            if last != f {
                self.members[li][at] = last;
                let j = flows[last as usize]
                    .links()
                    .iter()
                    .position(|&x| x == l)
                    .expect("a flow is on its links");
                self.slot[last as usize][j] = at as u32;
            }
            if self.members[li].is_empty() {
                let b = self.busy_at[li] as usize;
                let moved = self.busy.pop().expect("a busy link is listed");
                if moved != l {
                    self.busy[b] = moved;
                    self.busy_at[moved as usize] = b as u32;
                }
                self.busy_at[li] = u32::MAX;
            }
        }
    }

    /// Sets `rate[f]` for every active flow to its max-min fair share, capped flows at most
    /// `cap`.
    fn fill(
        &mut self,
        flows: &[Flow],
        active: &[u32],
        capacity: &[f64],
        cap: f64,
        rate: &mut [f64],
    ) {
        self.epoch += 1;
        let epoch = self.epoch;
        for &l in &self.busy {
            let li = l as usize;
            self.unfixed[li] = self.members[li].len() as u32;
            self.left[li] = capacity[li];
        }
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .busy
            .iter()
            .map(|&l| {
                let li = l as usize;
                Reverse((share_key(self.left[li] / f64::from(self.unfixed[li])), l))
            })
            .collect();
        let mut capped_left = cap.is_finite() && active.iter().any(|&f| flows[f as usize].capped);
        while let Some(Reverse((key, l))) = heap.pop() {
            let li = l as usize;
            let n = self.unfixed[li];
            if n == 0 {
                continue;
            }
            let share = (self.left[li] / f64::from(n)).max(0.0);
            if share_key(share) > key {
                // Freezing flows elsewhere only raises a link's share: re-queue it at its
                // current share (the popped key was a lower bound).
                heap.push(Reverse((share_key(share), l)));
                continue;
            }
            if capped_left && share >= cap {
                // Every link offers at least the cap: capped flows are held by their cap alone
                // (this is the per-peer cap as a private link of each flow, without the links).
                capped_left = false;
                for &f in active {
                    let fi = f as usize;
                    if self.fixed[fi] == epoch || !flows[fi].capped {
                        continue;
                    }
                    self.fixed[fi] = epoch;
                    rate[fi] = cap;
                    for &other in flows[fi].links() {
                        let oi = other as usize;
                        self.left[oi] = (self.left[oi] - cap).max(0.0);
                        self.unfixed[oi] -= 1;
                    }
                }
                if self.unfixed[li] > 0 {
                    let share = (self.left[li] / f64::from(self.unfixed[li])).max(0.0);
                    heap.push(Reverse((share_key(share), l)));
                }
                continue;
            }
            for k in 0..self.members[li].len() {
                let f = self.members[li][k] as usize;
                if self.fixed[f] == epoch {
                    continue;
                }
                self.fixed[f] = epoch;
                rate[f] = share;
                for &other in flows[f].links() {
                    let oi = other as usize;
                    if oi == li {
                        continue;
                    }
                    self.left[oi] = (self.left[oi] - share).max(0.0);
                    self.unfixed[oi] -= 1;
                }
            }
            self.unfixed[li] = 0;
        }
    }
}

/// Orders non-negative shares by their bit patterns (monotone for non-negative floats).
fn share_key(share: f64) -> u64 {
    share.max(0.0).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` flows of 1, 2, …, `n` MB over one link of `capacity` bytes per second, all started
    /// at 0: (the last finish, the number of finishes).
    fn staggered(n: u32, capacity: f64) -> (f64, usize) {
        let flows: Vec<Flow> = (1..=n)
            .map(|i| Flow {
                links: [0; MAX_LINKS],
                nlinks: 1,
                capped: false,
                bytes: f64::from(i) * 1e6,
            })
            .collect();
        let (mut last, mut finished) = (0.0f64, 0);
        let initial = (0..n).map(|f| (f, 0.0)).collect();
        run_gated(
            &flows,
            &[capacity],
            f64::INFINITY,
            initial,
            &mut |_, t, _| {
                last = last.max(t);
                finished += 1;
            },
        );
        (last, finished)
    }

    #[test]
    fn merged_events_leave_a_shared_link_idle_only_within_the_budget() {
        // Flows that finish one after another on a link they share: exactly, the link never
        // idles until the last one is done, so that one finishes when the link has moved all
        // their bytes. Merged events hold a finished flow's share until the event: at most
        // IDLE_FRACTION (10⁻³) of the time on the one link; with the fixed windows of 0.16
        // (10⁻³ of the clock) the last flow finished 0.19 % late.
        let (n, capacity) = (2000, 50e9);
        let (last, finished) = staggered(n, capacity);
        assert_eq!(finished, n as usize);
        let exact = f64::from(n) * f64::from(n + 1) / 2.0 * 1e6 / capacity;
        assert!(last >= exact * (1.0 - 1e-12), "{last} before {exact}");
        assert!(last <= exact * 1.001, "{last} against {exact}");
    }
}
