//! Max-min fair sharing of links by flows, event driven.
//!
//! Each flow crosses at most [`MAX_LINKS`] links (GPU egress and ingress, NVLink hops of PXN
//! routing, leaf uplinks and downlinks, a per-peer cap). Between events every link's capacity is shared max-min fairly
//! among the active flows crossing it (progressive filling: the most constrained link fixes the
//! rate of its flows, which then leave the problem); an event is flows becoming active or
//! finishing, after which rates are recomputed.
//!
//! Events closer together than a window of [`TIME_TOLERANCE`] × max(now, makespan floor) are
//! merged: flows finishing inside the window finish at their exact times but release their
//! capacity only at the window's end, and flows starting inside it start at its end. Both
//! err on the slow side by at most one window per event; it keeps the number of rate
//! recomputations in the hundreds when tens of thousands of flows end at nearly the same time.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Links one flow may cross.
pub(crate) const MAX_LINKS: usize = 5;

/// Width of the event-merging window, relative to the simulated clock (or to the makespan
/// floor early on).
const TIME_TOLERANCE: f64 = 1e-3;

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
    let mut filler = Filler::new(capacity.len());
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
        let horizon = first + TIME_TOLERANCE * now.max(floor);
        let mut at = first;
        let mut done: Vec<u32> = Vec::new();
        active.retain(|&f| {
            let fi = f as usize;
            if done_at[fi] <= horizon {
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

/// Progressive filling with scratch space reused across events (indexed by link).
struct Filler {
    /// Active flows crossing each link (valid for links in `touched`).
    count: Vec<u32>,
    /// Flows on each link whose rate is not fixed yet.
    unfixed: Vec<u32>,
    /// Capacity not yet given to fixed flows.
    left: Vec<f64>,
    /// CSR table: link `l`'s flows are `members[start[l]..start[l] + count[l]]`.
    start: Vec<u32>,
    cursor: Vec<u32>,
    members: Vec<u32>,
    fixed: Vec<bool>,
    touched: Vec<u32>,
}

impl Filler {
    fn new(links: usize) -> Filler {
        Filler {
            count: vec![0; links],
            unfixed: vec![0; links],
            left: vec![0.0; links],
            start: vec![0; links],
            cursor: vec![0; links],
            members: Vec::new(),
            fixed: Vec::new(),
            touched: Vec::new(),
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
        for &l in &self.touched {
            self.count[l as usize] = 0;
        }
        self.touched.clear();
        for &f in active {
            for &l in flows[f as usize].links() {
                if self.count[l as usize] == 0 {
                    self.touched.push(l);
                }
                self.count[l as usize] += 1;
            }
        }
        let mut offset = 0u32;
        for &l in &self.touched {
            let li = l as usize;
            self.start[li] = offset;
            self.cursor[li] = offset;
            offset += self.count[li];
            self.unfixed[li] = self.count[li];
            self.left[li] = capacity[li];
        }
        self.members.clear();
        self.members.resize(offset as usize, 0);
        for &f in active {
            for &l in flows[f as usize].links() {
                let li = l as usize;
                self.members[self.cursor[li] as usize] = f;
                self.cursor[li] += 1;
            }
        }
        if self.fixed.len() < flows.len() {
            self.fixed.resize(flows.len(), false);
        }
        for &f in active {
            self.fixed[f as usize] = false;
        }

        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .touched
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
                    if self.fixed[fi] || !flows[fi].capped {
                        continue;
                    }
                    self.fixed[fi] = true;
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
            let from = self.start[li] as usize;
            for k in from..from + self.count[li] as usize {
                let f = self.members[k] as usize;
                if self.fixed[f] {
                    continue;
                }
                self.fixed[f] = true;
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
