"""A model quantized as it loads lets go of the source pages it quantized: what stays
resident of the checkpoint's mapping is the tensors still used in place (norms), not the
weights (read from /proc/self/smaps: the kernel's own count for that mapping)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import coli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def resident_kib(path) -> int:
    """Rss of every mapping of ``path`` in this process, in KiB."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and ":" not in first:  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def private_copy(hf_models, tmp_path):
    """The tiny checkpoint under a path no other test maps (smaps is per path)."""
    import shutil

    return Path(shutil.copytree(hf_models("qwen3_moe"), tmp_path / "model"))


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_source_pages_are_released(hf_models, tmp_path, quant):
    model_dir = private_copy(hf_models, tmp_path)
    (weights,) = list(model_dir.glob("*.safetensors"))
    size_kib = weights.stat().st_size // 1024
    m = coli.load(model_dir, quant=quant, threads=1)
    try:
        # Of a tiny checkpoint, the tensors used in place (norms, the router) are interleaved with
        # the quantized ones, and the kernel maps up to 64 KiB of cached pages around each page
        # they touch; before pages were released, about 90% of the file stayed resident.
        assert resident_kib(weights) < size_kib * 0.6, (resident_kib(weights), size_kib)
    finally:
        m.close()


def test_released_pages_read_back_the_same_weights(hf_models, tmp_path):
    """Releasing is only about memory: a view into the released range reads the same values
    (the pages come back from the file), and the mapping's resident size shrinks meanwhile."""
    from coli.weights.safetensors import SafetensorsFile

    (path,) = list(private_copy(hf_models, tmp_path).glob("*.safetensors"))
    f = SafetensorsFile(path)
    views = {n: f.raw(n) for n in f.names()}
    copies = {n: v.copy() for n, v in views.items()}  # touches every page
    touched = resident_kib(path)
    for n in f.names():
        f.release(n)
    assert resident_kib(path) < touched // 4, (resident_kib(path), touched)
    assert all(np.array_equal(views[n], copies[n]) for n in f.names())
