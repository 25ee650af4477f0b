"""The kernel source as the compilers get it: kernels/microgpt_cuda.cu with the parts it
#includes (kernels/attn_*.cuh) written in place by andrea.cuda.launch.kernel_source, so that
NVRTC needs no include path and an edit to any part reaches every cache key; the emulator's
build cache. No GPU, no g++.
"""

from __future__ import annotations

import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

from andrea.cuda import emulator as kernel_emulator
from andrea.cuda import launch as kernel_launch
from andrea.resources import kernels_dir


def test_every_part_is_written_in_place_with_its_own_line_numbers() -> None:
    source = kernel_launch.kernel_source()
    assert not re.search(r'^#include "', source, re.M)
    parts = sorted(p.name for p in kernels_dir().glob("*.cuh"))
    assert parts == sorted(re.findall(r'^#line 1 "(attn_\w+\.cuh)"$', source, re.M))
    top = (kernels_dir() / kernel_launch.KERNEL_FILE).read_text().splitlines(keepends=True)
    for name in parts:
        # the part's text between its #line 1 and the #line that returns to the top file, which
        # names the top file's line after the #include
        m = re.search(rf'^#line 1 "{re.escape(name)}"\n(.*?)^#line (\d+) "microgpt_cuda.cu"\n',
                      source, re.M | re.S)
        assert m and m[1] == (kernels_dir() / name).read_text(), name
        assert top[int(m[2]) - 2] == f'#include "{name}"\n'


def test_an_edit_to_a_part_recompiles_the_module(monkeypatch, tmp_path) -> None:
    """The modules' cache (and CuPy's on disk) is keyed by the source text: a part's edit must
    change it, or a process would keep running the kernels from before the edit."""
    compiled = []

    class RawModule:
        def __init__(self, code, options, backend, name_expressions):
            compiled.append(code)

        def compile(self):
            pass

    fake = type(sys)("cupy")
    fake.RawModule = RawModule
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(kernel_launch, "_MODULES", {})
    copy = tmp_path / "kernels"
    shutil.copytree(kernels_dir(), copy)
    monkeypatch.setattr(kernel_launch, "kernels_dir", lambda: copy)
    names = kernel_launch.module_names("attn_fwd<bf16_t, 64>")

    before = kernel_launch.kernel_source()
    kernel_launch.compiled_module(before, "sm_90", names)
    kernel_launch.compiled_module(kernel_launch.kernel_source(), "sm_90", names)
    assert len(compiled) == 1  # the same text: served from the cache
    pipe = copy / "attn_pipe.cuh"
    pipe.write_text(pipe.read_text().replace("cp_async_wait<0>();", "cp_async_wait<0>(); ", 1))
    after = kernel_launch.kernel_source()
    assert after != before
    kernel_launch.compiled_module(after, "sm_90", names)
    assert compiled == [before, after]


def test_two_builders_of_one_emulator_build_compile_it_once(monkeypatch, tmp_path) -> None:
    """Two processes that want the same emulator build at once (the README's two test workers, a
    tuner's child process) compile it once: the second waits for the first and takes its file.
    Each used to run the compiler itself (8 s of CPU for the emulator's library). A stand-in
    compiler counts the compiles; two threads are two builders, as flock sees them."""
    compiles = tmp_path / "compiles"
    fake = tmp_path / "fake-g++"
    fake.write_text(f"""#!/bin/sh
[ "$1" = --version ] && {{ echo fake 1.0; exit 0; }}
echo compile >> {compiles}
sleep 1
while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done
""")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: kernel_emulator.build_library(), range(2)))
    assert built[0] == built[1] and built[0].is_file()
    assert compiles.read_text().splitlines() == ["compile"]
    assert kernel_emulator.build_library() == built[0]  # cached: no third compile
    assert compiles.read_text().splitlines() == ["compile"]
