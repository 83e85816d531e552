"""A corpus of hostile models and sample files (never committed: symlinks and FIFOs are made here).

    python models/hostile.py OUT_FOLDER

Each case is a folder ``OUT_FOLDER/<case>/`` holding ``model.onnx`` (and its data files); a
private file ``OUT_FOLDER/secret.bin`` lies outside every case's folder, and the cases that reach
for it name it by traversal, absolute path or symlink.  Every model is the same small graph,
``y = MatMul(x, W)`` with ``x: float[2, 4]`` and ``W: float[4, 4]``, so a case differs from a
good model only in what it declares.  ``OUT_FOLDER/npz/`` holds the hostile sample files for
``--inputs``, ``--calibrate`` and ``--data`` (and one good file of each kind).

``CASES`` says, per case, what onnxmp does with it: ``refused`` (a one-line error) or
``accepted`` (harmless: the data read is exactly the declared range inside the folder).
"""
from __future__ import annotations

import argparse
import os
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

SECRET = b"ONNXMP-SECRET-DO-NOT-READ-0123456789abcdefghijklmnopqrstuvwxyz!!"  # 64 bytes: one W
assert len(SECRET) == 64
W = (np.arange(16, dtype=np.float32).reshape(4, 4) - 7.5) / 8
DEPTH_LIMIT = 100  # protobuf's default recursion limit when parsing (python and C++)

# case -> what onnxmp does with it
CASES = {
    "traversal": "refused", "absolute": "refused", "symlink_escape": "refused", "device": "refused",
    "fifo": "refused", "huge_dims": "refused", "huge_dims_embedded": "refused", "negative_dims": "refused",
    "overflow_dims": "refused", "string_external": "refused", "negative_offset": "refused",
    "truncated": "refused", "oversized_length": "refused", "too_deep": "refused", "depth_limit": "refused", "cycle": "refused",
    "scope_collision": "refused", "overlapping_offsets": "accepted", "oversized_file": "accepted",
}
NPZ_CASES = {"pickle_file": "refused", "pickle_member": "refused", "lying_header": "refused",
             "zip_bomb": "refused"}


def _model(initializers, nodes=None, outputs=("y",), graph_inputs=None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    nodes = nodes if nodes is not None else [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "hostile", graph_inputs or [x],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2, 4]) for o in outputs],
                              initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _external(name: str, dims, location: str, data_type=TensorProto.FLOAT, **fields) -> TensorProto:
    tensor = TensorProto(name=name, data_type=data_type, dims=dims)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, **fields}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def _save(folder: Path, model: onnx.ModelProto | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    return path


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field: the nesting is written as bytes, since protobuf's own
    builders refuse (by parsing a copy) what exceeds its depth limit."""
    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
            value >>= 7
            if not value:
                return bytes(out)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _nested_if(depth: int) -> bytes:
    """A model of ``depth`` If nodes, each in the previous one's then-branch (3 message levels per If)."""
    leaf = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "leaf", [],
                             [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    else_branch = helper.make_attribute("else_branch", leaf)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], [f"t{depth}"])], f"g{depth}", [],
                              [helper.make_tensor_value_info(f"t{depth}", TensorProto.FLOAT, None)]).SerializeToString()
    for level in range(depth - 1, -1, -1):
        out = f"t{level}" if level else "y"
        node = helper.make_node("If", ["c"], [out])
        node.attribute.append(else_branch)
        then = onnx.AttributeProto(name="then_branch", type=onnx.AttributeProto.GRAPH).SerializeToString()
        node_bytes = node.SerializeToString() + _field(5, then + _field(6, graph))
        if level:
            shell = helper.make_graph([], f"g{level}", [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
        else:
            shell = _model([helper.make_tensor("c", TensorProto.BOOL, [], [True])], nodes=[]).graph
        graph = _field(1, node_bytes) + shell.SerializeToString()
    model = _model([], nodes=[])
    model.ClearField("graph")
    return model.SerializeToString() + _field(7, graph)


def write_model_cases(root: Path) -> dict[str, Path]:
    """Every case of :data:`CASES` under ``root`` (plus ``root/secret.bin``); returns case -> model path."""
    root.mkdir(parents=True, exist_ok=True)
    secret = root / "secret.bin"
    secret.write_bytes(SECRET)
    good = W.tobytes()
    paths = {}

    def external_case(case: str, location: str, data: bytes | None = b"", **fields) -> Path:
        folder = root / case
        folder.mkdir()
        if data:
            (folder / "w.bin").write_bytes(data)
        return _save(folder, _model([_external("W", [4, 4], location, **fields)]))

    def declared(case: str, tensor: TensorProto, data: bytes = good) -> Path:
        (root / case).mkdir()
        (root / case / "w.bin").write_bytes(data)
        return _save(root / case, _model([tensor]))

    paths["traversal"] = external_case("traversal", "../secret.bin")
    paths["absolute"] = external_case("absolute", str(secret.resolve()))
    paths["symlink_escape"] = external_case("symlink_escape", "w.bin", data=None)
    os.symlink("../secret.bin", root / "symlink_escape" / "w.bin")
    paths["device"] = external_case("device", "/dev/zero")
    paths["fifo"] = external_case("fifo", "w.bin", data=None)
    os.mkfifo(root / "fifo" / "w.bin")
    paths["huge_dims"] = declared("huge_dims", _external("W", [1 << 20, 1 << 20], "w.bin"), good[:16])
    huge = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[1 << 40], raw_data=bytes(16))  # 16 bytes
    paths["huge_dims_embedded"] = _save(root / "huge_dims_embedded", _model([huge]))
    paths["negative_dims"] = declared("negative_dims", _external("W", [-4, -4], "w.bin"))
    paths["overflow_dims"] = declared("overflow_dims", _external("W", [1 << 32, 1 << 32, 1 << 32], "w.bin"))
    paths["string_external"] = declared("string_external", _external("W", [4, 4], "w.bin", TensorProto.STRING))
    paths["negative_offset"] = external_case("negative_offset", "w.bin", data=good, offset=-16, length=64)
    paths["truncated"] = external_case("truncated", "w.bin", data=good[:32], offset=0, length=64)
    paths["oversized_length"] = external_case("oversized_length", "w.bin", data=good, offset=0, length=1 << 20)
    # Accepted: two tensors reading the same bytes, and a data file longer than what the model reads
    # (a file shared by many tensors is normal); only the declared range is ever read.
    folder = root / "overlapping_offsets"
    folder.mkdir()
    (folder / "w.bin").write_bytes(good)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("MatMul", ["h", "V"], ["y"], name="mm2")]
    paths["overlapping_offsets"] = _save(folder, _model(
        [_external("W", [4, 4], "w.bin", offset=0, length=64), _external("V", [4, 4], "w.bin", offset=0, length=64)],
        nodes=nodes))
    paths["oversized_file"] = external_case("oversized_file", "w.bin", data=good + SECRET[::-1] * 1024,
                                            offset=0, length=64)
    paths["too_deep"] = _save(root / "too_deep", _nested_if(DEPTH_LIMIT // 3 + 1))
    paths["depth_limit"] = _save(root / "depth_limit", _nested_if(DEPTH_LIMIT // 3 - 1))  # the deepest that parses
    cycle = [helper.make_node("Relu", ["b"], ["a"], name="r1"), helper.make_node("Relu", ["a"], ["b"], name="r2"),
             helper.make_node("MatMul", ["x", "W"], ["w1"], name="mm"), helper.make_node("Add", ["w1", "a"], ["y"])]
    paths["cycle"] = _save(root / "cycle", _model([helper.make_tensor("W", TensorProto.FLOAT, [4, 4], W.ravel())],
                                                  nodes=cycle))
    inner = helper.make_graph([helper.make_node("Relu", ["x"], ["h"], name="inner")], "then", [],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, None)])
    collide = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
               helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=inner, name="if")]
    paths["scope_collision"] = _save(root / "scope_collision", _model(
        [helper.make_tensor("W", TensorProto.FLOAT, [4, 4], W.ravel()), helper.make_tensor("c", TensorProto.BOOL, [], [True])],
        nodes=collide))
    return paths


def write_npz_cases(root: Path) -> dict[str, Path]:
    """Hostile sample files in ``root/npz/`` (and good ones: ``good_inputs``, ``good_data``)."""
    folder = root / "npz"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = {"good_inputs": folder / "good_inputs.npz", "good_data": folder / "good_data.npz"}
    np.savez(paths["good_inputs"], x=rng.standard_normal((2, 4)).astype(np.float32))
    np.savez(paths["good_data"], x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.standard_normal((8, 4)).astype(np.float32))
    paths["pickle_file"] = folder / "pickle_file.npz"  # a bare pickle, named .npz
    np.save(open(paths["pickle_file"], "wb"), np.array([{"x": 1}], dtype=object), allow_pickle=True)
    paths["pickle_member"] = folder / "pickle_member.npz"  # a real zip whose array is pickled objects
    np.savez(paths["pickle_member"], x=np.array([{"x": 1}, None], dtype=object),
             y=np.zeros((2, 4), np.float32))
    paths["lying_header"] = folder / "lying_header.npz"  # declares 2^40 floats over 16 bytes
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d,), }" % (1 << 40)
    header += " " * ((-(len(header) + 11)) % 64) + "\n"
    with zipfile.ZipFile(paths["lying_header"], "w") as archive:
        archive.writestr("x.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
                         + bytes(16))
        archive.writestr("y.npy", _npy(np.zeros((2, 4), np.float32)))
    paths["zip_bomb"] = folder / "zip_bomb.npz"  # 512 MiB of zeros, honestly declared, in ~0.5 MB
    rows = (512 << 20) // 16
    with zipfile.ZipFile(paths["zip_bomb"], "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            member.write(_npy_header(np.float32, (rows, 4)))
            chunk = bytes(16 << 20)
            for _ in range(32):
                member.write(chunk)
        archive.writestr("y.npy", _npy(np.zeros((2, 4), np.float32)))
    return paths


def _npy_header(dtype, shape) -> bytes:
    import io

    from numpy.lib import format as npy

    buffer = io.BytesIO()
    npy.write_array_header_1_0(buffer, {"descr": npy.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                                        "shape": shape})
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    for case, path in {**write_model_cases(args.out), **write_npz_cases(args.out)}.items():
        print(f"{case:22} {CASES.get(case) or NPZ_CASES.get(case, 'good')}: {path}")


if __name__ == "__main__":
    main()
