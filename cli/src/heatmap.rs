//! The rank-to-rank traffic heatmap of a plan as a standalone SVG (`refit --svg`): sender rows
//! × receiver columns, colour = bytes on a log scale, the training and inference rank ranges
//! marked along both axes, node boundaries as faint lines, a legend and a title.
//!
//! Rows span the ranks that send (at least the training ranks), columns those that receive
//! (at least the inference ranks): a refit onto separate ranks shows only the block that
//! carries traffic, a colocated one the whole square.

use crate::out;
use ncclreshard::RankProgram;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::ops::Range;

/// What the picture shows.
pub struct Heatmap<'a> {
    pub title: String,
    pub subtitle: String,
    pub train: (String, Range<u32>),
    pub infer: (String, Range<u32>),
    /// What the faint grid separates and how many ranks each holds (`("node", 8)`, or
    /// `("NVLink domain", 72)`); 0 ranks: no grid.
    pub group: (&'static str, u32),
    pub programs: &'a [RankProgram],
}

/// At most this many cells per axis; larger plans add up ranks into bins.
const MAX_CELLS: u32 = 256;
/// Cells with a tooltip (`<title>`) at most; beyond, the file would grow for little use.
const MAX_TOOLTIPS: usize = 20_000;
/// The longer side of the plot, in pixels.
const PLOT: f64 = 640.0;
const LEFT: f64 = 110.0;
const TOP: f64 = 140.0;
/// Thickness of one rank-range band.
const BAND: f64 = 12.0;
const LEGEND_X: f64 = LEFT + PLOT + 40.0;
const WIDTH: f64 = LEGEND_X + 140.0;
const HEIGHT: f64 = TOP + PLOT + 50.0;
/// Tick labels closer than this (pixels) are dropped.
const TICK_GAP: f64 = 22.0;
const TRAIN_COLOUR: &str = "#d95f02";
const INFER_COLOUR: &str = "#1b9e77";
/// Viridis, sampled at five stops: dark purple (few bytes) to yellow (most bytes).
const PALETTE: [(u8, u8, u8); 5] = [
    (0x44, 0x01, 0x54),
    (0x3b, 0x52, 0x8b),
    (0x21, 0x91, 0x8c),
    (0x5e, 0xc9, 0x62),
    (0xfd, 0xe7, 0x25),
];

fn colour(t: f64) -> String {
    let t = t.clamp(0.0, 1.0) * (PALETTE.len() - 1) as f64;
    let i = (t.floor() as usize).min(PALETTE.len() - 2);
    let f = t - i as f64;
    let mix = |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * f).round() as u8;
    let (a, b) = (PALETTE[i], PALETTE[i + 1]);
    format!(
        "#{:02x}{:02x}{:02x}",
        mix(a.0, b.0),
        mix(a.1, b.1),
        mix(a.2, b.2)
    )
}

/// Text safe inside an SVG element or attribute.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Bytes and messages per (sender, receiver) pair.
pub fn traffic(programs: &[RankProgram]) -> BTreeMap<(u32, u32), (u64, u64)> {
    let mut pairs: BTreeMap<(u32, u32), (u64, u64)> = BTreeMap::new();
    for p in programs {
        for m in &p.sends {
            let entry = pairs.entry((p.rank, m.peer)).or_default();
            entry.0 += m.bytes;
            entry.1 += 1;
        }
    }
    pairs
}

/// One axis of the plot: ranks `ranks.start..ranks.end`, `bin` ranks per cell.
struct Axis {
    ranks: Range<u32>,
    bin: u32,
    cell: f64,
    /// Pixel where the axis starts.
    origin: f64,
}

impl Axis {
    fn cells(&self) -> u32 {
        self.ranks.len().div_ceil(self.bin as usize) as u32
    }

    /// Pixel of the start of `rank`'s cell.
    fn at(&self, rank: u32) -> f64 {
        self.origin + f64::from((rank - self.ranks.start) / self.bin) * self.cell
    }

    /// Pixel of the end of the axis.
    fn end(&self) -> f64 {
        self.origin + f64::from(self.cells()) * self.cell
    }

    /// Tick positions: the ends and the edges of `marks` inside, then node starts, then any
    /// rank, as far as they leave room between labels.
    fn ticks(&self, marks: &[u32], gpus_per_node: u32) -> Vec<u32> {
        let last = self.ranks.end - 1;
        let priority = |r: u32| {
            if r == self.ranks.start || r == last || marks.contains(&r) {
                0
            } else if gpus_per_node > 0 && r / gpus_per_node != r.saturating_sub(1) / gpus_per_node
            {
                1
            } else {
                2
            }
        };
        let mut order: Vec<u32> = self.ranks.clone().collect();
        order.sort_by_key(|&r| (priority(r), r));
        let mut kept: Vec<u32> = Vec::new();
        for r in order {
            let px = self.at(r);
            if kept.iter().all(|&k| (self.at(k) - px).abs() >= TICK_GAP) {
                kept.push(r);
            }
        }
        kept.sort_unstable();
        kept
    }
}

/// Rank range covering `base` and every rank in `extra`.
fn span(base: &Range<u32>, extra: impl Iterator<Item = u32>) -> Range<u32> {
    let (mut lo, mut hi) = (base.start, base.end);
    for r in extra {
        lo = lo.min(r);
        hi = hi.max(r + 1);
    }
    lo..hi.max(lo + 1)
}

pub fn svg(map: &Heatmap) -> String {
    let pairs = traffic(map.programs);
    let rows = span(&map.train.1, pairs.keys().map(|&(from, _)| from));
    let cols = span(&map.infer.1, pairs.keys().map(|&(_, to)| to));
    let longest = rows.len().max(cols.len()) as u32;
    let bin = longest.div_ceil(MAX_CELLS).max(1);
    let cell = PLOT / f64::from(longest.div_ceil(bin));
    let y_axis = Axis {
        ranks: rows.clone(),
        bin,
        cell,
        origin: TOP,
    };
    let x_axis = Axis {
        ranks: cols.clone(),
        bin,
        cell,
        origin: LEFT,
    };
    let mut binned: BTreeMap<(u32, u32), (u64, u64)> = BTreeMap::new();
    for (&(from, to), &(bytes, messages)) in &pairs {
        if bytes == 0 {
            continue;
        }
        let entry = binned
            .entry(((from - rows.start) / bin, (to - cols.start) / bin))
            .or_default();
        entry.0 += bytes;
        entry.1 += messages;
    }
    let total_bytes: u64 = binned.values().map(|v| v.0).sum();
    let total_messages: u64 = binned.values().map(|v| v.1).sum();
    let lo = binned.values().map(|v| v.0).min().unwrap_or(1).max(1) as f64;
    let hi = binned.values().map(|v| v.0).max().unwrap_or(1).max(1) as f64;
    let scale = |bytes: f64| {
        if hi <= lo {
            1.0
        } else {
            (bytes.log10() - lo.log10()) / (hi.log10() - lo.log10())
        }
    };
    let (plot_w, plot_h) = (x_axis.end() - LEFT, y_axis.end() - TOP);

    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">
<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>
<text x="20" y="26" font-size="17" font-weight="bold">{}</text>
<text x="20" y="46" fill="#444">{}</text>
<text x="20" y="64" fill="#444">{} between ranks in {} messages · sender rows × receiver columns · colour = bytes per pair (log scale){}</text>"##,
        escape(&map.title),
        escape(&map.subtitle),
        out::bytes(total_bytes),
        out::count(total_messages),
        if bin > 1 {
            format!(" · {bin} ranks per cell")
        } else {
            String::new()
        }
    );

    // Rank-range bands: above the plot for receivers, left of it for senders; the training
    // range in the outer band, the inference range in the inner one.
    let bands = [
        (
            &map.train,
            TRAIN_COLOUR,
            TOP - 2.0 * BAND - 4.0,
            LEFT - 2.0 * BAND - 4.0,
        ),
        (
            &map.infer,
            INFER_COLOUR,
            TOP - BAND - 2.0,
            LEFT - BAND - 2.0,
        ),
    ];
    for ((label, range), fill, band_y, band_x) in bands {
        let name = escape(&format!(
            "{label} · ranks {}-{}",
            range.start,
            range.end.saturating_sub(1)
        ));
        let inside = |axis: &Axis| {
            let start = range.start.max(axis.ranks.start);
            let end = range.end.min(axis.ranks.end);
            (start < end).then(|| (axis.at(start), axis.at(end - 1) + axis.cell))
        };
        if let Some((a, b)) = inside(&x_axis) {
            let _ = writeln!(
                s,
                r#"<rect x="{a:.2}" y="{band_y:.2}" width="{:.2}" height="{:.2}" fill="{fill}"><title>{name}</title></rect>"#,
                b - a,
                BAND - 2.0
            );
        }
        if let Some((a, b)) = inside(&y_axis) {
            let _ = writeln!(
                s,
                r#"<rect x="{band_x:.2}" y="{a:.2}" width="{:.2}" height="{:.2}" fill="{fill}"><title>{name}</title></rect>"#,
                BAND - 2.0,
                b - a
            );
        }
    }
    let label_x = LEFT - 2.0 * BAND - 38.0;
    let _ = writeln!(
        s,
        r##"<rect x="20" y="80" width="12" height="10" fill="{TRAIN_COLOUR}"/>
<text x="36" y="89">{} (ranks {}-{})</text>
<rect x="{}" y="80" width="12" height="10" fill="{INFER_COLOUR}"/>
<text x="{}" y="89">{} (ranks {}-{})</text>
<text x="{:.2}" y="{}" text-anchor="middle" fill="#444">receiver rank →</text>
<text x="{label_x:.2}" y="{:.2}" text-anchor="middle" fill="#444" transform="rotate(-90 {label_x:.2} {:.2})">sender rank →</text>"##,
        escape(&map.train.0),
        map.train.1.start,
        map.train.1.end.saturating_sub(1),
        20.0 + PLOT / 2.0,
        36.0 + PLOT / 2.0,
        escape(&map.infer.0),
        map.infer.1.start,
        map.infer.1.end.saturating_sub(1),
        LEFT + plot_w / 2.0,
        TOP - 2.0 * BAND - 10.0,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0,
    );

    // The plot: background, cells, node grid, range edges.
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w:.2}" height="{plot_h:.2}" fill="#f2f2f2" stroke="#999" stroke-width="0.5"/>"##
    );
    let tooltips = binned.len() <= MAX_TOOLTIPS;
    s += "<g shape-rendering=\"crispEdges\">\n";
    for (&(row, col), &(bytes, messages)) in &binned {
        let _ = write!(
            s,
            r#"<rect x="{:.2}" y="{:.2}" width="{cell:.2}" height="{cell:.2}" fill="{}""#,
            LEFT + f64::from(col) * cell,
            TOP + f64::from(row) * cell,
            colour(scale(bytes as f64)),
        );
        if tooltips {
            let (from, to) = (rows.start + row * bin, cols.start + col * bin);
            let who = if bin > 1 {
                format!(
                    "ranks {from}-{} → {to}-{}",
                    (from + bin - 1).min(rows.end - 1),
                    (to + bin - 1).min(cols.end - 1)
                )
            } else {
                format!("rank {from} → {to}")
            };
            let _ = writeln!(
                s,
                "><title>{who}: {} in {} messages</title></rect>",
                out::bytes(bytes),
                out::count(messages)
            );
        } else {
            s += "/>\n";
        }
    }
    s += "</g>\n";
    // Colocated ranks copy their own overlap locally: outline those diagonal cells.
    for p in map.programs {
        let local = p.bytes_copied_locally();
        if local == 0 || !rows.contains(&p.rank) || !cols.contains(&p.rank) {
            continue;
        }
        let _ = writeln!(
            s,
            r##"<rect x="{:.2}" y="{:.2}" width="{cell:.2}" height="{cell:.2}" fill="none" stroke="#e7298a" stroke-width="1.5"><title>rank {}: {} copied locally</title></rect>"##,
            x_axis.at(p.rank),
            y_axis.at(p.rank),
            p.rank,
            out::bytes(local)
        );
    }
    let (group_name, gpus_per_node) = map.group;
    let node_px = f64::from(gpus_per_node) / f64::from(bin) * cell;
    if gpus_per_node > 0 && node_px >= 4.0 {
        for axis in [&x_axis, &y_axis] {
            let mut node = axis.ranks.start.next_multiple_of(gpus_per_node);
            while node < axis.ranks.end {
                if node > axis.ranks.start {
                    let p = axis.at(node);
                    let (x1, y1, x2, y2) = if axis.origin == LEFT {
                        (p, TOP, p, TOP + plot_h)
                    } else {
                        (LEFT, p, LEFT + plot_w, p)
                    };
                    let _ = writeln!(
                        s,
                        r##"<line x1="{x1:.2}" y1="{y1:.2}" x2="{x2:.2}" y2="{y2:.2}" stroke="#c8c8c8" stroke-width="0.5"/>"##
                    );
                }
                node += gpus_per_node;
            }
        }
    }
    let marks: Vec<u32> = [
        map.train.1.start,
        map.train.1.end,
        map.infer.1.start,
        map.infer.1.end,
    ]
    .into_iter()
    .collect();
    for &edge in &marks {
        if edge > x_axis.ranks.start && edge < x_axis.ranks.end {
            let p = x_axis.at(edge);
            let _ = writeln!(
                s,
                r##"<line x1="{p:.2}" y1="{TOP}" x2="{p:.2}" y2="{:.2}" stroke="#333" stroke-dasharray="4 3"/>"##,
                TOP + plot_h
            );
        }
        if edge > y_axis.ranks.start && edge < y_axis.ranks.end {
            let p = y_axis.at(edge);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{p:.2}" x2="{:.2}" y2="{p:.2}" stroke="#333" stroke-dasharray="4 3"/>"##,
                LEFT + plot_w
            );
        }
    }
    for rank in x_axis.ticks(&marks, gpus_per_node) {
        let _ = writeln!(
            s,
            r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" font-size="10" fill="#444">{rank}</text>"##,
            x_axis.at(rank) + cell / 2.0,
            TOP + plot_h + 14.0
        );
    }
    for rank in y_axis.ticks(&marks, gpus_per_node) {
        let _ = writeln!(
            s,
            r##"<text x="{:.2}" y="{:.2}" text-anchor="end" font-size="10" fill="#444">{rank}</text>"##,
            LEFT - 2.0 * BAND - 8.0,
            y_axis.at(rank) + cell / 2.0 + 3.5
        );
    }

    // Colour legend: a vertical gradient, most bytes on top, min, max and decades between.
    s += "<defs><linearGradient id=\"scale\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">\n";
    for i in 0..PALETTE.len() {
        let t = i as f64 / (PALETTE.len() - 1) as f64;
        let _ = writeln!(s, r#"<stop offset="{t:.2}" stop-color="{}"/>"#, colour(t));
    }
    let legend_h = PLOT / 2.0;
    let _ = writeln!(
        s,
        r##"</linearGradient></defs>
<text x="{LEGEND_X}" y="{:.2}" font-weight="bold">bytes per pair</text>
<rect x="{LEGEND_X}" y="{TOP}" width="18" height="{legend_h}" fill="url(#scale)" stroke="#999" stroke-width="0.5"/>"##,
        TOP - 10.0
    );
    let tick_y = |bytes: f64| TOP + legend_h * (1.0 - scale(bytes));
    let mut ticks = vec![hi, lo];
    let mut decade = 10f64.powf(lo.log10().ceil());
    while decade < hi {
        if [hi, lo]
            .iter()
            .all(|&end| (tick_y(end) - tick_y(decade)).abs() >= 14.0)
        {
            ticks.push(decade);
        }
        decade *= 10.0;
    }
    if hi <= lo {
        ticks.truncate(1);
    }
    for tick in ticks {
        let ty = tick_y(tick);
        let _ = writeln!(
            s,
            r##"<line x1="{}" y1="{ty:.2}" x2="{}" y2="{ty:.2}" stroke="#333"/>
<text x="{}" y="{:.2}" font-size="10">{}</text>"##,
            LEGEND_X + 18.0,
            LEGEND_X + 22.0,
            LEGEND_X + 25.0,
            ty + 3.5,
            out::bytes(tick.round() as u64)
        );
    }
    let key_y = TOP + legend_h + 24.0;
    let _ = writeln!(
        s,
        r##"<rect x="{LEGEND_X}" y="{key_y}" width="18" height="12" fill="#f2f2f2" stroke="#999" stroke-width="0.5"/>
<text x="{}" y="{}" font-size="10">no traffic</text>
<line x1="{LEGEND_X}" y1="{}" x2="{}" y2="{}" stroke="#333" stroke-dasharray="4 3"/>
<text x="{}" y="{}" font-size="10">train / infer edge</text>
<line x1="{LEGEND_X}" y1="{}" x2="{}" y2="{}" stroke="#c8c8c8"/>
<text x="{}" y="{}" font-size="10">{group_name} edge ({gpus_per_node} GPUs)</text>
<rect x="{LEGEND_X}" y="{}" width="18" height="12" fill="none" stroke="#e7298a" stroke-width="1.5"/>
<text x="{}" y="{}" font-size="10">local copy (colocated)</text>
</svg>"##,
        LEGEND_X + 25.0,
        key_y + 10.0,
        key_y + 26.0,
        LEGEND_X + 18.0,
        key_y + 26.0,
        LEGEND_X + 25.0,
        key_y + 30.0,
        key_y + 44.0,
        LEGEND_X + 18.0,
        key_y + 44.0,
        LEGEND_X + 25.0,
        key_y + 48.0,
        key_y + 58.0,
        LEGEND_X + 25.0,
        key_y + 68.0,
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclreshard::plan::{Buffer, Loc, Message};

    fn sender(rank: u32, peer: u32, bytes: u64) -> RankProgram {
        let loc = Loc {
            buffer: Buffer::Src,
            tensor: 0,
            offset: 0,
        };
        RankProgram {
            rank,
            sends: vec![Message { peer, loc, bytes }],
            ..Default::default()
        }
    }

    #[test]
    fn large_plans_add_ranks_up_into_bins() {
        // 600 training ranks each send to one of 600 inference ranks: 3 ranks per cell.
        let programs: Vec<RankProgram> = (0..600).map(|r| sender(r, 600 + r, 1000)).collect();
        let map = Heatmap {
            title: "t <&>".into(),
            subtitle: "s".into(),
            train: ("train".into(), 0..600),
            infer: ("infer".into(), 600..1200),
            group: ("node", 8),
            programs: &programs,
        };
        let svg = svg(&map);
        assert!(svg.contains("3 ranks per cell"), "{svg}");
        assert!(svg.contains("t &lt;&amp;&gt;"));
        assert!(svg.contains("600.00 kB between ranks in 600 messages"));
        // The diagonal: 200 cells of 3 pairs each.
        assert_eq!(svg.matches("<title>ranks ").count(), 200);
        assert!(svg.contains("<title>ranks 0-2 → 600-602: 3.00 kB in 3 messages</title>"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn colours_run_from_dark_to_light() {
        assert_eq!(colour(0.0), "#440154");
        assert_eq!(colour(1.0), "#fde725");
        assert_eq!(colour(2.0), "#fde725");
    }
}
