"""Lists pairs of Rust modules of `src/` that use each other (a module that
imports a module that imports it back), and each module's lines and unsafe
markers. Exit status 1 if a pair exists. Test modules (`tests.rs`,
`#[cfg(test)] mod tests`) are left out: they may use anything."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "src"
UNSAFE = re.compile(r"unsafe \{|unsafe fn|unsafe extern|unsafe impl")


def module_of(path: pathlib.Path) -> tuple[str, ...]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return tuple(parts)


def main() -> int:
    files = {module_of(p): p for p in ROOT.rglob("*.rs") if p.name != "tests.rs"}
    def resolve(path: tuple[str, ...]):
        while path and path not in files:
            path = path[:-1]
        return path or None
    uses: dict[tuple, set] = {m: set() for m in files}
    for m, p in files.items():
        text = p.read_text()
        text = text.split("#[cfg(test)]\nmod tests {")[0]
        # Comments may name anything.
        text = re.sub(r"//.*", "", text)
        for kind, rest in re.findall(r"\b(crate|super)((?:::[a-z_][a-z0-9_]*)+)", text):
            names = tuple(rest.strip(":").split("::"))
            base = () if kind == "crate" else (m if p.name == "mod.rs" else m[:-1])
            if kind == "super":
                base = base[:-1] if p.name == "mod.rs" else base
            target = resolve(base + names)
            if target and target != m and not (target == m[: len(target)]):
                uses[m].add(target)
        # `use super::{a, b}` groups
        for kind, group in re.findall(r"\b(crate|super)::\{([^}]*)\}", text):
            base = () if kind == "crate" else (m[:-1] if p.name != "mod.rs" else m[:-1])
            for name in re.findall(r"\b([a-z_][a-z0-9_]*)\b", group):
                target = resolve(base + (name,))
                if target and target != m and not (target == m[: len(target)]):
                    uses[m].add(target)
    pairs = sorted({tuple(sorted((a, b))) for a in uses for b in uses[a] if a in uses.get(b, ())})
    if "--table" in sys.argv:
        for m in sorted(files):
            p = files[m]
            text = p.read_text()
            print(f"{str(p.relative_to(ROOT.parent)):42s} {len(text.splitlines()):5d} {len(UNSAFE.findall(text)):3d}")
    for a, b in pairs:
        print("cycle:", "::".join(a), "<->", "::".join(b))
    return 1 if pairs else 0


if __name__ == "__main__":
    sys.exit(main())
