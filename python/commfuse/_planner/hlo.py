"""One device's compiled program, read from its HLO text, as the ops of a
price request (``src/sim/step.rs``; ``price.py`` sends it).

The text is ``compiled.as_text()`` of a JAX compile: the SPMD partitioner's
per-device program after XLA's optimizations, with fusions, while loops and
custom calls. Each instruction becomes what it costs on a device:

- ``dot``: a ``gemm`` op, also each dot inside a fusion;
- a fusion: the gemm ops of its dots, plus a ``memory`` op of the bytes
  it reads and writes outside them;
- XLA's collectives (all-gather, all-reduce, reduce-scatter, all-to-all,
  collective-permute; their ``-start``/``-done`` pairs priced at the start,
  what reads the done depending on the start): a ``collective`` op;
- a commfuse custom call: a ``fused`` op with its ``CallShapes``;
- ``while``: a ``loop`` op of its body; ``conditional``: a
  ``conditional`` op of its branches; ``call``: its computation, inlined;
- parameters, constants, tuples, get-tuple-element, bitcasts and the like:
  nothing; everything else: a ``memory`` op of its result's bytes (an
  in-place dynamic-update-slice: of its update's).

A device id is a position in the flattened device assignment (for a
commfuse call, in its ``mesh_devices``); devices ``i`` and ``j`` share a
node when ``i // devices_per_node == j // devices_per_node``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from .. import _abi

# Bytes per element of XLA's primitive types (sub-byte ints rounded up).
_ELEMENT_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0, "opaque": 0,
}
# XLA's float type names and their dtype names (``DType::name``, numpy's).
_FLOATS = {
    "f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16",
    "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
}
# The dtype a GEMM of other element types is priced at, by element width
# (int8 products as fp8: one byte per operand, the model's 16-bit peak).
_GEMM_DTYPE_BY_WIDTH = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32", 8: "float64"}

# Instructions that cost nothing: they name, regroup or reinterpret buffers.
_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "partition-id", "replica-id", "after-all",
    "opt-barrier", "optimization-barrier", "add-dependency", "domain", "get-dimension-size",
})
# XLA's collectives by opcode, as the request names their kinds.
_COLLECTIVES = {
    "all-gather": "all-gather",
    "all-reduce": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
}
# Ops a value passes through unchanged but for its type or layout: where the
# CPU compiler widened a bf16 operand to f32, the narrow type is before them.
_VALUE_PRESERVING = frozenset({"convert", "bitcast", "copy", "transpose", "reshape"})
# Work that only changes precision or layout (`parse`'s `fold_layout`).
_LAYOUT = frozenset({"convert", "copy", "transpose", "reshape", "broadcast"})
# Ops reading only the part of their first operand that their result is.
_PARTIAL_READS = frozenset({"dynamic-slice", "slice", "gather"})

FUSED_TARGET_PREFIX = "commfuse_collective_matmul"


@dataclass
class Instruction:
    """One HLO instruction: ``name = type opcode(operands), attributes``."""
    name: str
    type: str
    opcode: str
    operands: list
    operand_text: str
    attributes: dict


@dataclass
class Computation:
    """A computation's instructions in program order, by name, and its root."""
    name: str
    instructions: list
    by_name: dict
    root: Instruction
    _users: dict | None = None

    def users(self, name: str) -> list:
        """The instructions of this computation reading `name`."""
        if self._users is None:
            self._users = {}
            for inst in self.instructions:
                for operand in inst.operands:
                    self._users.setdefault(operand, []).append(inst)
        return self._users.get(name, [])


@dataclass
class Module:
    """An HLO module: its computations by name, its entry, and the number of
    partitions and replicas it was compiled for."""
    computations: dict
    entry: Computation
    num_partitions: int
    replica_count: int


@dataclass
class Program:
    """A compiled program as a price request's ``ops``, the number of
    devices it was compiled for, and what could only be guessed."""
    ops: list
    devices: int
    warnings: list = field(default_factory=list)


def parse(hlo_text: str, *, devices_per_node: int | None = None, fold_layout: bool = False) -> Program:
    """The price request's ops of the module in `hlo_text` (``compiled.as_text()``):
    one list in program order, each op ``{"deps": [...], <kind>: {...}}``;
    collectives and fused ops cross nodes where a group spans devices of
    more than one node of `devices_per_node` (None: one node).

    `fold_layout`: price nothing for work that only changes a value's
    precision or layout (converts, copies, transposes, broadcasts, alone or
    fused together). A CPU compile widens 16-bit dots' operands to f32 and
    lays them out for its GEMM in such fusions; on a GPU the GEMM takes the
    16-bit operands and either layout itself, and XLA fuses the rest into
    its neighbours: pricing a CPU compile for a GPU, they are not there."""
    if devices_per_node is not None and devices_per_node < 1:
        raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
    module = parse_module(hlo_text)
    reader = _Reader(module, devices_per_node, fold_layout)
    ops = []
    reader.read(module.entry, [], ops)
    return Program(ops, reader.devices, reader.warnings)


# --------------------------------------------------------------------------
# The text: computations of instructions
# --------------------------------------------------------------------------
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OPENING = {"(": ")", "{": "}", "[": "]"}
_STRUCTURE = re.compile(r'[()\[\]{},"]')
_QUOTED_END = re.compile(r'\\.|"')


def _structure(text: str, start: int = 0):
    """The (index, character) of each bracket and comma in `text` from
    `start`, outside quoted strings."""
    at = start
    while True:
        found = _STRUCTURE.search(text, at)
        if found is None:
            return
        at = found.end()
        if found.group() != '"':
            yield found.start(), found.group()
            continue
        while True:  # to the quote's end, past escapes
            end = _QUOTED_END.search(text, at)
            if end is None:
                return
            at = end.end()
            if end.group() == '"':
                break


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at `text[start]` (quoted
    strings skipped), or len(text) when it is not closed."""
    stack = []
    for i, c in _structure(text, start):
        if c in _OPENING:
            stack.append(_OPENING[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
    return len(text)


def _split_top_level(text: str) -> list:
    """`text` split at the commas outside brackets and quotes."""
    parts, depth, start = [], 0, 0
    for i, c in _structure(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _instruction(line: str):
    """The instruction on `line` and whether it is its computation's root, or None."""
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    at = head.end()
    if line.startswith("(", at):
        type_end = _closing(line, at) + 1
    else:
        type_end = at
        while type_end < len(line) and not line[type_end].isspace():
            type_end += 1
    opcode = _OPCODE.match(line, type_end)
    if opcode is None:
        return None
    open_at = opcode.end() - 1
    close_at = _closing(line, open_at)
    operand_text = line[open_at + 1:close_at]
    attributes = {}
    last = None
    for part in _split_top_level(line[close_at + 1:]):
        key, _, value = part.partition("=")
        key = key.strip()
        if key == "device_ids" and last == "replica_groups":
            # The mesh form of a permuted mesh continues past a comma:
            # ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}``.
            attributes[last] += f", {part.strip()}"
            continue
        attributes[key] = value.strip()
        last = key
    inst = Instruction(head.group(2), line[at:type_end], opcode.group(1), _OPERAND.findall(operand_text),
                       operand_text, attributes)
    return inst, head.group(1) is not None


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text, its entry, and the number
    of partitions and replicas it was compiled for."""
    computations, entry, current = {}, None, None
    partitions = re.search(r"\bnum_partitions=(\d+)", text)
    replicas = re.search(r"\breplica_count=(\d+)", text)
    for line in text.splitlines():
        if current is None:
            header = _COMPUTATION.match(line)
            if header and not line.startswith("HloModule"):
                current = (header.group(2), header.group(1) is not None, [], None)
            continue
        if line.strip() == "}":
            name, is_entry, instructions, root = current
            if instructions:
                computation = Computation(name, instructions, {i.name: i for i in instructions},
                                          root or instructions[-1])
                computations[name] = computation
                if is_entry:
                    entry = computation
            current = None
            continue
        parsed = _instruction(line)
        if parsed is not None:
            inst, is_root = parsed
            current[2].append(inst)
            if is_root:
                current = (current[0], current[1], current[2], inst)
    if entry is None:
        raise ValueError("not the text of an HLO module: no ENTRY computation")
    return Module(computations, entry, int(partitions.group(1)) if partitions else 1,
                  int(replicas.group(1)) if replicas else 1)


# --------------------------------------------------------------------------
# Types and attributes
# --------------------------------------------------------------------------
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


def arrays(type_text: str) -> list:
    """The (element type, dims) of each array in a type (a tuple's in order)."""
    return [(element, tuple(int(d) for d in re.findall(r"\d+", dims)))
            for element, dims in _ARRAY.findall(type_text)]


def type_bytes(type_text: str) -> int:
    """The bytes of every array in a type."""
    return sum(_ELEMENT_BYTES.get(e, 4) * math.prod(dims) for e, dims in arrays(type_text))


def _ints(text: str | None) -> list:
    """Every integer in `text`, in order."""
    return [int(v) for v in re.findall(r"-?\d+", text or "")]


def _computation_names(text: str | None) -> list:
    """The computation names an attribute lists (``%a`` or ``{%a, %b}``)."""
    return re.findall(r"%?([\w.\-]+)", (text or "").strip("{} "))


def _mlir_dict(text: str) -> dict:
    """The integer entries of an MLIR attribute dictionary as XLA prints a
    typed-FFI custom call's ``backend_config``: ``k = 1 : i64`` gives 1,
    ``k = dense<[1, 2]> : tensor<2xi64>`` and ``k = array<i64: 1, 2>`` give
    [1, 2] (``dense<3> : tensor<2xi64>``, a splat, gives [3, 3])."""
    out = {}
    for key, dense, shape, array, scalar in re.findall(
            r"(\w+)\s*=\s*(?:dense<([^>]*)>\s*:\s*tensor<([^>]*)>|array<\w+:?([^>]*)>|(-?\d+)\s*:\s*[iu]\d+)",
            text):
        if dense or shape:
            values = _ints(dense)
            count = math.prod(int(d) for d in shape.split("x")[:-1])
            out[key] = values * count if len(values) == 1 else values
        elif scalar:
            out[key] = int(scalar)
        else:
            out[key] = _ints(array)
    return out


# --------------------------------------------------------------------------
# Replica groups
# --------------------------------------------------------------------------
def replica_groups(text: str | None, devices: int) -> list:
    """The device groups of a ``replica_groups`` attribute, in any of XLA's
    forms: ``{{0,1},{2,3}}``; iota, ``[2,4]<=[8]`` or ``[2,4]<=[4,2]T(1,0)``;
    mesh axes, ``mesh['a'=2,'b'=4] {'b'}`` (with ``device_ids=(...)`` for a
    permuted mesh, and sub-axes ``'a':(1)2``); none or ``{}``: one group of
    all `devices`."""
    text = (text or "").strip()
    if text in ("", "{}"):
        return [list(range(devices))]
    if text.startswith("{"):
        return [_ints(group) for group in re.findall(r"\{([^{}]*)\}", text)]
    if text.startswith("["):
        return _iota(text).tolist()
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if text.startswith("maximal_mesh"):
        return [_ints(text)[:1]]
    raise ValueError(f"replica groups of an unknown form: {text!r}")


def _iota(text: str) -> np.ndarray:
    """The device array of an iota tile assignment, ``[dims]<=[reshape]T(perm)``."""
    m = re.match(r"\[([\d,\s]*)\]\s*<=\s*\[([\d,\s]*)\](?:\s*T\(([\d,\s]*)\))?", text)
    if m is None:
        # ``[2,4]T(1,0)``: the iota of those dims, transposed, as one list.
        short = re.match(r"\[([\d,\s]*)\]\s*T\(([\d,\s]*)\)", text)
        if short is None:
            raise ValueError(f"not an iota device list: {text!r}")
        reshape, perm = _ints(short.group(1)), _ints(short.group(2))
        return np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).reshape(-1)
    dims, reshape, perm = _ints(m.group(1)), _ints(m.group(2)), _ints(m.group(3))
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(dims)


def _mesh_groups(text: str) -> list:
    """The groups of XLA's mesh-axes form: the mesh's device array cut along
    the named axes (or sub-axes)."""
    open_at = text.index("[")
    close_at = _closing(text, open_at)
    axes = []
    for part in _split_top_level(text[open_at + 1:close_at]):
        name, _, size = part.rpartition("=")
        axes.append((name.strip().strip("'\""), int(size)))
    rest = text[close_at + 1:]
    sizes = [size for _, size in axes]
    ids = np.arange(math.prod(sizes))
    found = re.search(r"device_ids=\(", rest)
    if found:
        start = found.end() - 1
        listed = rest[start + 1:_closing(rest, start)]
        if "<=" in listed or re.match(r"\s*\[[\d,\s]*\]\s*T\(", listed):
            ids = _iota(listed).reshape(-1)
        else:
            ids = np.asarray(_ints(listed))
        rest = rest[_closing(rest, start) + 1:]
    brace = rest.index("{")
    grouped = _split_top_level(rest[brace + 1:_closing(rest, brace)])
    names = [name for name, _ in axes]
    # Each mesh axis cut into (size, grouped) pieces, major first: a sub-axis
    # "a:(pre)size" is the piece of `size` after `pre` of axis a.
    pieces = {i: [] for i in range(len(axes))}
    for ref in grouped:
        m = re.match(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?$", ref.strip())
        if m is None or m.group(1) not in names:
            raise ValueError(f"mesh replica groups name an unknown axis {ref!r}: {text!r}")
        axis = names.index(m.group(1))
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (1, sizes[axis])
        pieces[axis].append((pre, size))
    shape, grouped_dims = [], []
    for axis, full in enumerate(sizes):
        prefix = 1
        for pre, size in sorted(pieces[axis]):
            if pre != prefix:
                shape.append(pre // prefix)
                prefix = pre
            grouped_dims.append(len(shape))
            shape.append(size)
            prefix *= size
        if prefix != full:
            shape.append(full // prefix)
    kept = [d for d in range(len(shape)) if d not in grouped_dims]
    per_group = math.prod(shape[d] for d in grouped_dims)
    return ids.reshape(shape).transpose(kept + grouped_dims).reshape(-1, per_group).tolist()


# --------------------------------------------------------------------------
# The walk: instructions to ops
# --------------------------------------------------------------------------
class _Reader:
    """Turns computations into ops, remembering what it had to guess."""

    def __init__(self, module: Module, devices_per_node: int | None, fold_layout: bool = False):
        self.module = module
        self.devices_per_node = devices_per_node
        self.fold_layout = fold_layout
        self.devices = module.num_partitions * module.replica_count
        self.warnings = []

    def computation(self, name: str) -> Computation:
        """The module's computation `name` (ValueError if there is none)."""
        try:
            return self.module.computations[name]
        except KeyError:
            raise ValueError(f"the module has no computation {name!r}") from None

    def crosses_nodes(self, groups) -> bool:
        """Whether any group holds devices of more than one node."""
        if self.devices_per_node is None:
            return False
        return any(len({d // self.devices_per_node for d in g}) > 1 for g in groups)

    def read(self, computation: Computation, params: list, ops: list) -> frozenset:
        """Appends `computation`'s ops to `ops` (their deps index `ops`),
        its parameter i read from the ops in `params[i]`; returns the ops
        its root's value comes from."""
        producers = {}
        for inst in computation.instructions:
            reads = [producers.get(o, frozenset()) for o in inst.operands]
            producers[inst.name] = self.instruction(inst, computation, params, reads, ops)
        return producers.get(computation.root.name, frozenset())

    def instruction(self, inst: Instruction, computation: Computation, params: list, reads: list,
                    ops: list) -> frozenset:
        """Appends what `inst` costs to `ops`; returns the ops its value comes from."""
        deps = frozenset().union(*reads)
        opcode = inst.opcode

        def emit(**cost) -> frozenset:
            """Appends the op of `cost` reading `deps`; returns it as the value's producer."""
            ops.append({"deps": sorted(deps), **cost})
            return frozenset({len(ops) - 1})

        if opcode == "parameter":
            index = _ints(inst.operand_text)[0]
            return params[index] if index < len(params) else frozenset()
        if opcode in _FREE or opcode.endswith("-done") or opcode.endswith("-update"):
            return deps
        if opcode.endswith("-start") and "calls" in inst.attributes:
            # An async wrapper: its computation runs (a collective, or inlined).
            wrapped = self.computation(_computation_names(inst.attributes["calls"])[0])
            if wrapped.root.opcode in _COLLECTIVES:
                return emit(collective=self.collective(wrapped.root, wrapped, start=False))
            return self.read(wrapped, reads, ops) | deps
        base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        if base in _COLLECTIVES:
            if base == "collective-permute" and not _ints(inst.attributes.get("source_target_pairs")):
                return deps
            return emit(collective=self.collective(inst, computation, start=opcode != base))
        if opcode == "dot":
            return emit(gemm=self.gemm(inst, computation, ()))
        if self.fold_layout and (opcode in _LAYOUT or (opcode == "fusion" and self.layout_only(inst))):
            return deps
        if opcode == "fusion":
            return self.fusion(inst, computation, deps, ops)
        if opcode == "custom-call" and inst.attributes.get("custom_call_target", "").strip('"').startswith(
                FUSED_TARGET_PREFIX):
            return emit(fused=self.fused(inst, computation))
        if opcode == "while":
            body = []
            self.read(self.computation(_computation_names(inst.attributes.get("body"))[0]), [], body)
            return emit(loop={"trip_count": self.trip_count(inst), "ops": body})
        if opcode == "conditional":
            names = _computation_names(inst.attributes.get("branch_computations"))
            names = names or [_computation_names(inst.attributes.get(k))[0]
                              for k in ("true_computation", "false_computation")]
            branches = []
            for name in names:
                branches.append([])
                self.read(self.computation(name), [], branches[-1])
            return emit(conditional={"branches": branches})
        if opcode == "call":
            called = self.computation(_computation_names(inst.attributes.get("to_apply"))[0])
            return self.read(called, reads, ops) | deps
        if opcode == "dynamic-update-slice":
            # In place: it writes its update's bytes, not the whole buffer.
            return emit(memory={"bytes": self.operand_bytes(computation, inst, 1)})
        bytes_ = type_bytes(inst.type)
        return emit(memory={"bytes": bytes_}) if bytes_ else deps

    def operand_bytes(self, computation: Computation, inst: Instruction, index: int) -> int:
        """The bytes of `inst`'s operand `index` (0 when it has none)."""
        if index >= len(inst.operands) or inst.operands[index] not in computation.by_name:
            return 0
        return type_bytes(computation.by_name[inst.operands[index]].type)

    # -- collectives --------------------------------------------------------
    def collective(self, inst: Instruction, computation: Computation, start: bool) -> dict:
        """The request's ``collective`` of an XLA collective (or its start)."""
        base = inst.opcode[:-len("-start")] if start else inst.opcode
        operand = sum(self.operand_bytes(computation, inst, i) for i in range(len(inst.operands)))
        result = type_bytes(inst.type)
        if start and base in ("all-gather", "collective-permute"):
            result -= operand  # their start's result holds the operands too
        if base == "collective-permute":
            pairs = re.findall(r"\{(\d+),(\d+)\}", inst.attributes.get("source_target_pairs", ""))
            groups = [[int(a), int(b)] for a, b in pairs]
            ranks = max(2, len({d for g in groups for d in g}))
        else:
            groups = replica_groups(inst.attributes.get("replica_groups"), self.devices)
            ranks = max((len(g) for g in groups), default=1)
        return {"kind": _COLLECTIVES[base], "bytes": max(operand, result), "ranks": ranks,
                "crosses_nodes": self.crosses_nodes(groups)}

    # -- commfuse's fused ops -----------------------------------------------
    def fused(self, inst: Instruction, computation: Computation) -> dict:
        """The request's ``fused`` op of a commfuse custom call: the call's
        shapes as ``_abi.call_shapes`` gives them, decoded from its attributes
        (``_fused._lower_target``) and operand and result types."""
        attributes = _mlir_dict(inst.attributes.get("backend_config", ""))
        missing = [k for k in ("kind", "schedule", "dimension", "mesh_devices", "mesh_shape", "axes")
                   if k not in attributes]
        if missing:
            raise ValueError(f"commfuse call {inst.name}: its attributes lack {missing}")
        mesh_shape, axes = attributes["mesh_shape"], attributes["axes"]
        ranks = math.prod(mesh_shape[a] for a in axes)
        operands = [arrays(computation.by_name[o].type)[0] for o in inst.operands[:2]]
        result = arrays(inst.type)[0]
        call = _abi.call_shapes(attributes["kind"], attributes["schedule"], ranks, attributes["dimension"],
                                operands[0][1], operands[1][1], _dtype(operands[0][0]), _dtype(result[0]))
        devices = np.asarray(attributes["mesh_devices"]).reshape(mesh_shape)
        kept = [d for d in range(len(mesh_shape)) if d not in axes]
        groups = devices.transpose(kept + list(axes)).reshape(-1, ranks).tolist()
        return {"call": call._asdict(), "crosses_nodes": self.crosses_nodes(groups)}

    # -- loops ----------------------------------------------------------------
    def trip_count(self, inst: Instruction) -> int:
        """A while loop's trip count: XLA's ``known_trip_count``, else the
        constant its condition compares the counter with (a loop counting
        from 0 by 1), else 1 with a warning."""
        known = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', inst.attributes.get("backend_config", ""))
        if known:
            return int(known.group(1))
        condition = self.computation(_computation_names(inst.attributes.get("condition"))[0])
        count = self.compared_constant(condition, condition.root, ())
        if count is None:
            self.warnings.append(f"while {inst.name}: no trip count found; priced as one trip")
            return 1
        return max(0, count)

    def compared_constant(self, computation: Computation, inst: Instruction, outer: tuple):
        """The trip count a loop condition's ``counter < constant`` (or <=,
        or mirrored) gives, looking into a fusion at the root; None if it is
        not one."""
        if inst.opcode == "fusion":
            called = self.computation(_computation_names(inst.attributes.get("calls"))[0])
            return self.compared_constant(called, called.root, outer + ((computation, inst),))
        if inst.opcode != "compare" or len(inst.operands) != 2:
            return None
        values = [self.constant(computation, o, outer) for o in inst.operands]
        direction = inst.attributes.get("direction", "")
        if values[1] is not None and values[0] is None:
            return {"LT": values[1], "LE": values[1] + 1, "NE": values[1]}.get(direction)
        if values[0] is not None and values[1] is None:
            return {"GT": values[0], "GE": values[0] + 1, "NE": values[0]}.get(direction)
        return None

    def constant(self, computation: Computation, name: str, outer: tuple):
        """The integer value of a scalar constant `name` (through fusion parameters), or None."""
        inst = computation.by_name.get(name)
        if inst is None:
            return None
        if inst.opcode == "constant":
            values = _ints(inst.operand_text)
            return values[0] if len(values) == 1 else None
        if inst.opcode == "parameter" and outer:
            parent, fusion = outer[-1]
            index = _ints(inst.operand_text)[0]
            return self.constant(parent, fusion.operands[index], outer[:-1]) if index < len(fusion.operands) else None
        return None

    # -- products and fusions -------------------------------------------------
    def gemm(self, inst: Instruction, computation: Computation, outer: tuple) -> dict:
        """The request's ``gemm`` of a dot (`outer`: the fusions it is inside,
        innermost last, each as (the computation holding it, the fusion)).

        The CPU compiler computes bf16 products in f32, converting the
        operands first (and the result back). Each operand is priced at the
        narrowest type its value had on the way from the dot back through
        converts, bitcasts, copies, transposes and reshapes (into fusions and
        out of their parameters), where those are visible; the product at
        the wider of its two operands' (as XLA promotes them), and its
        result, where its operands were widened so, at that type too."""
        (lhs_type, lhs), (rhs_type, rhs) = (arrays(computation.by_name[o].type)[0] for o in inst.operands[:2])
        out_type = arrays(inst.type)[0][0]
        a = inst.attributes
        lhs_batch, lhs_contract = _ints(a.get("lhs_batch_dims")), _ints(a.get("lhs_contracting_dims"))
        rhs_batch, rhs_contract = _ints(a.get("rhs_batch_dims")), _ints(a.get("rhs_contracting_dims"))
        free = lambda dims, used: math.prod(d for i, d in enumerate(dims) if i not in used)
        narrowest = [self.narrowest(computation, o, outer) for o in inst.operands[:2]]
        input_type = max(narrowest, key=_width)
        widened = _width(input_type) < max(_width(lhs_type), _width(rhs_type))
        output_type = input_type if widened and _width(out_type) >= _width(lhs_type) else out_type
        return {"batch": math.prod(lhs[i] for i in lhs_batch), "m": free(lhs, lhs_batch + lhs_contract),
                "k": math.prod(lhs[i] for i in lhs_contract), "n": free(rhs, rhs_batch + rhs_contract),
                "input": _gemm_dtype(input_type), "output": _gemm_dtype(output_type)}

    def narrowest(self, computation: Computation, name: str, outer: tuple, depth: int = 0) -> str:
        """The narrowest element type value `name` had before value-preserving ops (see `gemm`)."""
        inst = computation.by_name.get(name)
        found = arrays(inst.type) if inst is not None else []
        if len(found) != 1 or depth > 64:
            return found[0][0] if found else "f32"
        own = found[0][0]
        before = None
        if inst.opcode in _VALUE_PRESERVING and inst.operands:
            before = self.narrowest(computation, inst.operands[0], outer, depth + 1)
        elif inst.opcode == "fusion":
            called = self.computation(_computation_names(inst.attributes.get("calls"))[0])
            before = self.narrowest(called, called.root.name, outer + ((computation, inst),), depth + 1)
        elif inst.opcode == "parameter" and outer:
            parent, fusion = outer[-1]
            index = _ints(inst.operand_text)[0]
            if index < len(fusion.operands):
                before = self.narrowest(parent, fusion.operands[index], outer[:-1], depth + 1)
        if before is None or before == "pred":
            return own
        return min(own, before, key=_width)

    def fusion(self, inst: Instruction, computation: Computation, deps: frozenset, ops: list) -> frozenset:
        """Appends a fusion's ops: a gemm per dot inside, and the memory work
        of the bytes it reads and writes beyond its dots' operands and results."""
        called = self.computation(_computation_names(inst.attributes.get("calls"))[0])
        emitted = []
        dot_bytes = 0
        for dot, holder, outer in self.dots(called, ((computation, inst),)):
            ops.append({"deps": sorted(deps), "gemm": self.gemm(dot, holder, outer)})
            emitted.append(len(ops) - 1)
            dot_bytes += type_bytes(dot.type) + sum(self.operand_bytes(holder, dot, i) for i in range(2))
        moved = max(0, self.fusion_bytes(inst, computation, called) - dot_bytes)
        if moved or not emitted:
            ops.append({"deps": sorted(deps), "memory": {"bytes": moved}})
            emitted.append(len(ops) - 1)
        return frozenset(emitted)

    def layout_only(self, inst: Instruction) -> bool:
        """Whether a fusion only changes precision or layout (see `parse`'s `fold_layout`)."""
        called = self.computation(_computation_names(inst.attributes.get("calls"))[0])
        return all(i.opcode in _LAYOUT or i.opcode in _FREE or i.opcode == "parameter"
                   or (i.opcode == "fusion" and self.layout_only(i)) for i in called.instructions)

    def dots(self, computation: Computation, outer: tuple):
        """The dots of a fused computation and nested ones: (dot, the
        computation holding it, the fusions it is inside)."""
        for inst in computation.instructions:
            if inst.opcode == "dot":
                yield inst, computation, outer
            elif inst.opcode == "fusion":
                called = self.computation(_computation_names(inst.attributes.get("calls"))[0])
                yield from self.dots(called, outer + ((computation, inst),))

    def fusion_bytes(self, inst: Instruction, computation: Computation, called: Computation) -> int:
        """The bytes a fusion reads and writes: its result (an in-place
        dynamic-update-slice writes only its update) and its operands (one
        that is only sliced is read only where sliced; an in-place buffer
        not at all)."""
        roots = [called.by_name.get(o) for o in called.root.operands] if called.root.opcode == "tuple" \
            else [called.root]
        written = 0
        for root in roots:
            if root is None:
                continue
            if root.opcode == "dynamic-update-slice":
                written += self.operand_bytes(called, root, 1)
            else:
                written += type_bytes(root.type)
        read = 0
        params = {_ints(p.operand_text)[0]: p for p in called.instructions if p.opcode == "parameter"}
        for index, operand in enumerate(inst.operands):
            param = params.get(index)
            users = called.users(param.name) if param is not None else []
            if users and all(u.opcode in _PARTIAL_READS and u.operands[0] == param.name for u in users):
                read += sum(type_bytes(u.type) for u in users)
            elif users and all(u.opcode == "dynamic-update-slice" and u.operands[0] == param.name
                               for u in users):
                continue
            elif operand in computation.by_name:
                read += type_bytes(computation.by_name[operand].type)
        return written + read


def _width(element_type: str) -> int:
    """Bytes per element of an XLA element type."""
    return _ELEMENT_BYTES.get(element_type, 4)


def _gemm_dtype(element_type: str) -> str:
    """The dtype name (``DType::name``) a GEMM of `element_type` is priced at."""
    return _FLOATS.get(element_type) or _GEMM_DTYPE_BY_WIDTH.get(_width(element_type), "float32")


def _dtype(element_type: str):
    """The numpy dtype of an XLA float type a commfuse call takes."""
    if element_type not in _FLOATS:
        raise ValueError(f"a commfuse call of element type {element_type}, which the library does not take")
    return jnp.dtype(_FLOATS[element_type])


def op_counts(ops: list) -> dict:
    """How many ops of each kind `ops` holds, as written (loop bodies and
    branches once each); collectives by their kind, e.g. ``"all-gather"``."""
    counts = {}
    for op in ops:
        if "collective" in op:
            kind = op["collective"]["kind"]
        else:
            kind = next(k for k in op if k != "deps")
        counts[kind] = counts.get(kind, 0) + 1
        if "loop" in op:
            for k, n in op_counts(op["loop"]["ops"]).items():
                counts[k] = counts.get(k, 0) + n
        for branch in op.get("conditional", {}).get("branches", []):
            for k, n in op_counts(branch).items():
                counts[k] = counts.get(k, 0) + n
    return counts

