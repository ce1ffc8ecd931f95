"""The causal-LM loader's refusals are one line, whatever the library raised: transformers' message
for a class that needs a package it cannot import (Gemma 3n's timm vision tower) spans several lines."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from _factories import ARCH_CONFIGS
from safetensors.torch import save_file

from deltazip.formats.errors import InputError
from deltazip.models.loader import load_causal_lm


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm installed: the tower builds")
def test_a_class_that_needs_a_missing_package_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ARCH_CONFIGS["gemma3n_vl"]))
    save_file({}, str(tmp_path / "model.safetensors"))  # weights present: the class itself is what fails
    with pytest.raises(InputError) as e:
        load_causal_lm(tmp_path, torch.float32, what="base")
    msg = str(e.value)
    assert msg.startswith(f"base {tmp_path} cannot be loaded as a causal LM (ImportError: ") and "timm" in msg, msg
    assert "\n" not in msg, msg
