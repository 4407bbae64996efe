"""Tensors cast or quantized on the way (docs/quantization.md) from Python: ``dst_dtype`` and
``Quant`` reach the JSON case format (which ``ncclreshard check`` verifies bit for bit against
the reference quantizer) and the C structs (plan info, exported convert steps and wire dtypes),
and bad values are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ncclreshard as nr
from conftest import run_cli

# [512, 384] bf16 rows over ranks 0-1 -> columns over ranks 2-4 as FP8 in 128 x 128 blocks: each
# source shard holds whole blocks, so the senders quantize and FP8 travels.
WEIGHT = nr.TensorSpec(
    "w", (512, 384), torch.bfloat16, nr.Layout([2], 0, [nr.Shard(0)]),
    nr.Layout([3], 2, [nr.Shard(1)]), dst_dtype=torch.float8_e4m3fn, quant=nr.Quant("block"),
)
# Rows over three ranks (cuts at 171 and 342): blocks straddle them, the receivers quantize.
STRADDLING = nr.TensorSpec(
    "w2", (512, 384), torch.bfloat16, nr.Layout([3], 0, [nr.Shard(0)]),
    nr.Layout([3], 3, [nr.Shard(1)]), dst_dtype="float8_e4m3fn",
    quant=nr.Quant("block", block=(128, 128), scale_format="e8m0", scale_inverse=True),
)
CAST = nr.TensorSpec(
    "norm", (33, 17), torch.float32, nr.Layout([3], 0, [nr.Shard(0)]),
    nr.Layout([2], 3, [nr.Shard(1)]), dst_dtype=torch.bfloat16,
)


def test_json_round_trip_and_cli_check(cli: Path, tmp_path: Path) -> None:
    cases = [nr.Case((spec,), name=spec.name) for spec in (WEIGHT, STRADDLING, CAST)]
    for case in cases:
        assert nr.Case.loads(case.dumps()) == [case]
        # The conversion is part of the plan's fingerprint, and survives the JSON.
        with nr.Plan(case, 0) as here, nr.Plan(nr.Case.loads(case.dumps())[0], 0) as there:
            assert here.fingerprint == there.fingerprint
    plain = nr.TensorSpec("w", WEIGHT.shape, WEIGHT.dtype, WEIGHT.src, WEIGHT.dst)
    with nr.Plan([plain], 0) as a, nr.Plan([WEIGHT], 0) as b:
        assert a.fingerprint != b.fingerprint
    quant = WEIGHT.to_json()
    assert quant["dst_dtype"] == "float8_e4m3fn"
    assert quant["quant"] == {"scheme": "block"}
    assert STRADDLING.to_json()["quant"] == {
        "scheme": "block", "block": [128, 128], "scale_format": "e8m0", "scale_inverse": True
    }
    path = tmp_path / "quantize.json"
    path.write_text(json.dumps([c.to_json() for c in cases]))
    result = run_cli(cli, "check", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    # No groupable variant for tensors that convert: staged and auto each.
    assert result.stdout.strip().splitlines()[-1] == "6 passed, 0 failed"


def test_plans_report_scales_workspace_and_fp8_on_the_wire() -> None:
    with nr.Plan([WEIGHT], 0) as sender:
        info = sender.info
        assert info.scale_tensors == 1
        assert info.work_bytes >= 256 * 384 + 2 * 3 * 4
        transfers = sender.transfers()
        converts = [t for t in transfers if t.kind == "convert"]
        assert converts and all(t.src_dtype == torch.bfloat16 for t in converts)
        assert all(t.dst_dtype == torch.float8_e4m3fn and t.dst_view == "converted" for t in converts)
        data = [t for t in transfers if t.kind == "send" and t.tensor == 0]
        assert sum(t.bytes for t in data) == 256 * 384  # one byte per element
        assert all(t.src_view == "converted" for t in data)
    with nr.Plan([STRADDLING], 3) as receiver:
        transfers = receiver.transfers()
        converts = [t for t in transfers if t.kind == "convert"]
        assert converts and all(t.src_view == "unconverted" for t in converts)
        bf16 = sum(t.bytes for t in transfers if t.kind == "recv" and t.src_dtype == torch.bfloat16)
        assert bf16 == 2 * 256 * 128


def test_bad_conversions_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="scheme"):
        nr.Quant("blocky")
    with pytest.raises(ValueError, match="only the block scheme"):
        nr.Quant("per_tensor", block=(1, 32))
    with pytest.raises(ValueError, match="needs dst_dtype"):
        nr.TensorSpec("w", (4, 4), torch.bfloat16, WEIGHT.src, WEIGHT.dst, quant=nr.Quant())
    int8 = nr.TensorSpec("w", (512, 384), torch.bfloat16, WEIGHT.src, WEIGHT.dst, dst_dtype=torch.int8)
    with pytest.raises(nr.NcclReshardError, match=r"tensors\[0\]"):
        nr.Plan([int8], 0)
    with pytest.raises(ValueError, match=r"tensors\[0\]\.quant: Quant\.scheme is 'blocky'"):
        nr.TensorSpec.from_json(
            {**WEIGHT.to_json(), "quant": {"scheme": "blocky"}}, "tensors[0]"
        )
    with nr.Plan([WEIGHT], 2) as plan:
        with pytest.raises(ValueError, match="scales has 0 entries"):
            plan.reshard_pointers([None], [1], comm=0)
