"""zero_engine.hf refuses a corrupt safetensors header exactly where safetensors does, naming the file and tensor.

Each bad file is built by hand (a few bytes): the installed ``safetensors`` must refuse it too (so the rule is
safetensors', not ours), and zero_engine must refuse it at open, before any byte of data is read, with its own
message. Files safetensors accepts (header padded with spaces, an empty tensor, an extra header field) are
accepted too.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

st = pytest.importorskip("safetensors.torch")
safetensors = pytest.importorskip("safetensors")

from zero_engine.hf._files import open_tensor_file  # noqa: E402
from zero_engine.hf._header import InvalidSafetensorsError  # noqa: E402


def _file(header, data: bytes, header_len=None, raw=None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if header_len is None else header_len) + text + data


def _t(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# name -> (file bytes, what our message must contain besides the path)
BAD = {
    "k_proj_on_q_proj_bytes": (_file({"q_proj": _t("F32", [2], 0, 8), "k_proj": _t("F32", [2], 0, 8),
                                      "o_proj": _t("F32", [2], 8, 16)}, bytes(16)), "'k_proj'"),
    "range_shorter_than_shape": (_file({"q_proj": _t("F32", [4], 0, 8), "k_proj": _t("F32", [2], 8, 16)},
                                       bytes(16)), "'q_proj' (F32, shape [4]) needs 16 bytes"),
    "range_longer_than_shape": (_file({"q_proj": _t("F32", [1], 0, 8)}, bytes(8)), "'q_proj'"),
    "gap_between_tensors": (_file({"q_proj": _t("F32", [2], 0, 8), "k_proj": _t("F32", [2], 12, 20)}, bytes(20)),
                            "'k_proj' begins at byte 12"),
    "past_end_of_file": (_file({"q_proj": _t("F32", [2], 0, 8), "k_proj": _t("F32", [2], 8, 16)}, bytes(12)),
                         "'k_proj'"),
    "bytes_after_last_tensor": (_file({"q_proj": _t("F32", [2], 0, 8)}, bytes(12)), "cover 8"),
    "begin_after_end": (_file({"q_proj": _t("F32", [0], 8, 0)}, bytes(8)), "'q_proj'"),
    "header_length_2_pow_40": (_file(None, b"", header_len=1 << 40, raw=b"{}"), "1099511627776"),
    "header_length_past_file": (_file(None, b"", header_len=1000, raw=b"{}"), "past the end of the file"),
    "shorter_than_8_bytes": (b"\x01\x02", "fewer than the 8-byte header length"),
    "header_not_json": (_file(None, b"", raw=b"{nope"), "not valid JSON"),
    "header_not_utf8": (_file(None, b"", raw=b'{"\xff":1}'), "not UTF-8"),
    "header_a_list": (_file(None, b"", raw=b"[1, 2]"), "not an object"),
    "unknown_dtype": (_file({"q_proj": _t("X9", [2], 0, 8)}, bytes(8)), "'q_proj' has dtype 'X9'"),
    "negative_shape": (_file({"q_proj": _t("F32", [-2], 0, 8)}, bytes(8)), "'q_proj'"),
    "missing_offsets": (_file({"q_proj": {"dtype": "F32", "shape": [2]}}, bytes(8)), "'q_proj'"),
    "metadata_not_strings": (_file({"__metadata__": {"a": 1}, "q_proj": _t("F32", [2], 0, 8)}, bytes(8)),
                             "__metadata__"),
    "duplicate_key": (_file(None, bytes(16), raw=b'{"q_proj":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                                  b'"q_proj":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'),
                      "'q_proj' appears twice"),
}

GOOD = {
    "header_padded_with_spaces": _file(None, struct.pack("<2f", 1.5, -2.0),
                                       raw=json.dumps({"w": _t("F32", [2], 0, 8)}).encode() + b"      "),
    "empty_tensor_beside_another": _file({"e": _t("F32", [0], 0, 0), "w": _t("F32", [2], 0, 8)},
                                         struct.pack("<2f", 1.5, -2.0)),
    "extra_field_and_metadata": _file({"__metadata__": {"format": "pt"}, "w": {**_t("F32", [2], 0, 8), "x": 1}},
                                      struct.pack("<2f", 1.5, -2.0)),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_header_refused_like_safetensors(tmp_path, name):
    blob, detail = BAD[name]
    path = str(tmp_path / f"{name}.safetensors")
    with open(path, "wb") as f:
        f.write(blob)
    with pytest.raises(safetensors.SafetensorError):
        st.load_file(path)
    with pytest.raises(InvalidSafetensorsError) as caught:
        open_tensor_file(path, "safetensors")
    message = str(caught.value)
    assert path in message and detail in message, message


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_headers_accepted_like_safetensors(tmp_path, name):
    path = str(tmp_path / f"{name}.safetensors")
    with open(path, "wb") as f:
        f.write(GOOD[name])
    expected = st.load_file(path)
    reader = open_tensor_file(path, "safetensors")
    try:
        for key, tensor in expected.items():
            out = torch.empty(tensor.numel(), dtype=tensor.dtype)
            reader.read_into(key, 0, tensor.numel(), out)
            assert torch.equal(out, tensor.reshape(-1)), key
    finally:
        reader.close()


def test_real_checkpoint_with_k_proj_pointing_at_q_proj_is_refused(tmp_path):
    """The attack of issue 20: a transformers checkpoint whose k_proj offsets are q_proj's (same size, so the
    sizes agree) loaded silently with k_proj == q_proj. safetensors refuses it and so does zero_engine."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {f"model.layers.0.self_attn.{n}.weight": torch.randn(8, 8) for n in ("q_proj", "k_proj", "v_proj")}
    path = str(tmp_path / "model.safetensors")
    save_file(state, path)
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header["model.layers.0.self_attn.k_proj.weight"]["data_offsets"] = \
        header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    text = json.dumps(header).encode()  # offsets count from the data section: it may move
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + blob[8 + n:])
    with pytest.raises(safetensors.SafetensorError, match="invalid offset"):
        st.load_file(path)
    with pytest.raises(InvalidSafetensorsError, match="overlaps") as caught:
        open_tensor_file(path, "safetensors")
    assert path in str(caught.value) and "k_proj" in str(caught.value)
