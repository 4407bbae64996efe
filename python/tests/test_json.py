"""JSON in the CLI's case-file format: what Python writes, `ncclreshard check` runs and
`ncclreshard layout --json` reads the same way (every rank's local shape and indices); what
the repository's own case files say, Python reads the same way; round trips are exact."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List

import pytest
import torch

import ncclreshard as nr
from conftest import REPO, run_cli

DTYPES = [torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.float8_e4m3fn]


def _random_layout(rng: random.Random, ndim: int, world: int) -> nr.Layout:
    axes = rng.randint(1, 2)
    shape = [rng.randint(1, 3)] + ([rng.randint(1, 2)] if axes == 2 else [])
    count = shape[0] * (shape[1] if axes == 2 else 1)
    ranks = rng.sample(range(world), count) if rng.random() < 0.5 else rng.randint(0, world - count)
    placements: List[nr.Placement] = []
    for _ in range(axes):
        roll = rng.random()
        if roll < 0.3:
            placements.append(nr.Replicate())
        elif roll < 0.75:
            placements.append(nr.Shard(rng.randrange(ndim)))
        else:
            placements.append(nr.StridedShard(rng.randrange(ndim), rng.randint(1, 3)))
    return nr.Layout(shape, ranks, placements)


def _random_case(rng: random.Random, index: int) -> nr.Case:
    tensors = []
    for t in range(rng.randint(1, 3)):
        ndim = rng.randint(1, 3)
        shape = [rng.randint(1, 9) for _ in range(ndim)]
        src = _random_layout(rng, ndim, 8)
        dst = _random_layout(rng, ndim, 8)
        if rng.random() < 0.3:
            # A padded destination view: every local row is 3 elements wider than the tensor's.
            widths = list(shape)
            widths[-1] += 3
            dst = dst.with_strides([int(torch.tensor(widths[d + 1:]).prod()) for d in range(ndim)])
        tensors.append(nr.TensorSpec(f"t{index}.{t}", shape, rng.choice(DTYPES), src, dst))
    config = rng.choice([
        nr.Config(),
        nr.Config(mode="staged", ranks_per_node=4, rounds=2),
        nr.Config(mode="groupable"),
        nr.Config(mode="auto", node_of_rank=(0, 0, 0, 0, 1, 1, 1, 1), relay=False, split_min_bytes=16),
        nr.Config(mode="auto", ranks_per_node=2, rounds=3, sender_barrier=True),
    ])
    return nr.Case(tuple(tensors), config, name=f"case-{index}")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> "tuple[Path, List[nr.Case]]":
    rng = random.Random(7)
    cases = [_random_case(rng, i) for i in range(30)]
    path = tmp_path_factory.mktemp("cases") / "python-written.json"
    path.write_text(json.dumps([c.to_json() for c in cases], indent=1))
    return path, cases


def test_cli_check_runs_what_python_writes(cli: Path, written) -> None:
    path, cases = written
    result = run_cli(cli, "check", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    runs = sum(3 if c.config.mode is None else 1 for c in cases)
    assert result.stdout.strip().splitlines()[-1] == f"{runs} passed, 0 failed"


def test_cli_reads_the_layouts_python_means(cli: Path, written) -> None:
    path, cases = written
    for i, case in enumerate(cases):
        single = path.with_name(f"one-{i}.json")
        single.write_text(case.dumps())
        result = run_cli(cli, "layout", str(single), "--json")
        assert result.returncode == 0, result.stderr
        shown = json.loads(result.stdout)
        shown_tensors = shown["tensors"] if "tensors" in shown else [shown]
        assert len(shown_tensors) == len(case.tensors)
        for spec, seen in zip(case.tensors, shown_tensors):
            for side in ("src", "dst"):
                layout = getattr(spec, side)
                assert [r["rank"] for r in seen[side]] == list(layout.ranks)
                for entry in seen[side]:
                    rank = entry["rank"]
                    assert tuple(entry["shape"]) == nr.local_shape(layout, spec.shape, rank)
                    runs = nr.local_runs(layout, spec.shape, rank)
                    assert [[list(r) for r in dim] for dim in runs] == entry["indices"]
                    assert entry.get("strides") == (list(layout.strides) if layout.strides else None)


def test_round_trip_is_exact(written) -> None:
    path, cases = written
    assert nr.Case.loads(path.read_text()) == cases
    for case in cases:
        assert nr.Case.loads(case.dumps()) == [case]
        # Shipped to another process as JSON, the plan is the same plan.
        with nr.Plan(case, 0) as here, nr.Plan(nr.Case.loads(case.dumps())[0], 0) as there:
            assert here.fingerprint == there.fingerprint


@pytest.mark.parametrize("file", sorted((REPO / "cases").glob("*.json")), ids=lambda p: p.name)
def test_python_reads_the_repository_case_files_like_the_cli(cli: Path, file: Path) -> None:
    cases = nr.Case.loads(file.read_text())
    result = run_cli(cli, "layout", str(file), "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    shown = shown if isinstance(shown, list) else [shown]
    assert len(shown) == len(cases)
    for case, seen_case in zip(cases, shown):
        seen_tensors = seen_case["tensors"] if "tensors" in seen_case else [seen_case]
        for spec, seen in zip(case.tensors, seen_tensors):
            for side in ("src", "dst"):
                for entry in seen[side]:
                    layout = getattr(spec, side)
                    # With failed ranks the CLI shows the survivors' plan, renumbered.
                    rank = case.config.original_of(entry["rank"])
                    assert tuple(entry["shape"]) == nr.local_shape(layout, spec.shape, rank)


def test_json_errors_name_the_key() -> None:
    good = {"shape": [4], "dtype": "float32", "src": {"mesh": [2], "placements": ["Shard(0)"]},
            "dst": {"mesh": [1], "first_rank": 2, "placements": ["Replicate"]}}
    with pytest.raises(ValueError, match=r"case\.dst\.colour: unknown key"):
        nr.Case.from_json({**good, "dst": {**good["dst"], "colour": 1}})
    with pytest.raises(ValueError, match=r"case\.src\.placements\[0\] 'Shard\(x\)'"):
        nr.Case.from_json({**good, "src": {"mesh": [2], "placements": ["Shard(x)"]}})
    with pytest.raises(ValueError, match=r"case\.src\.placements\[0\] 'Partial\(\)': Partial is not supported"):
        nr.Case.from_json({**good, "src": {"mesh": [2], "placements": ["Partial()"]}})
    with pytest.raises(ValueError, match=r"case\.dtype: unknown dtype 'float128'"):
        nr.Case.from_json({**good, "dtype": "float128"})
    with pytest.raises(ValueError, match=r"case\.config: mode is 'fast'"):
        nr.Case.from_json({**good, "config": {"mode": "fast"}})
    with pytest.raises(ValueError, match=r"give either ranks or first_rank"):
        nr.Case.from_json({**good, "src": {"mesh": [1], "ranks": [0], "first_rank": 0, "placements": ["R"]}})
