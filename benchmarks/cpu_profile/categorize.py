"""Where a ``perf record`` of ``workload.py`` spent its samples, by kind of work (issue 40).

    perf report -i perf.data --stdio --sort dso,sym --no-children -q | python categorize.py

Each symbol goes to the first category whose patterns it matches (the library it lives in and
its name); prints one JSON object: category -> percent of the samples.
"""

import json
import re
import sys

#: (category, library pattern, symbol pattern), first match wins.
RULES = [
    ("GEMM (OpenBLAS kernel and packing)", r"openblas", r"gemm|kernel|copy"),
    ("GEMM (torch: oneDNN / MKL)", r"libtorch_cpu|libmkl|dnnl", r"gemm|brgemm|jit|mkl_blas|sgemm|dnnl"),
    ("torch attention kernel", r"libtorch_cpu", r"flash|sdpa|attention"),
    ("exp", r".", r"exp"),
    ("bfloat16 / float16 casts", r"ml_dtypes|_multiarray_umath|libtorch_cpu",
     r"bfloat16|half|float16|cast.*(HALF|half)|(HALF|half).*cast|npy_half|bf16"),
    ("other casts and copies", r".", r"cast|copy|memmove|memcpy|memset|to_contig|assign"),
    ("reductions (row max, sums)", r"_multiarray_umath|libtorch_cpu", r"reduce|maximum|max|sum|add"),
    ("other NumPy / torch elementwise", r"_multiarray_umath|_umath|libtorch_cpu", r"."),
    ("Python interpreter and GC", r"libpython|python3", r"."),
    ("kernel (page faults, scheduling)", r"kernel", r"."),
]


def main() -> None:
    out: dict[str, float] = {}
    for line in sys.stdin:
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)", line)
        if not m:
            continue
        pct, lib, sym = float(m.group(1)), m.group(2), m.group(3)
        for name, lib_re, sym_re in RULES:
            if re.search(lib_re, lib, re.I) and re.search(sym_re, sym, re.I):
                break
        else:
            name = "other"
        out[name] = round(out.get(name, 0.0) + pct, 1)
    print(json.dumps(dict(sorted(out.items(), key=lambda kv: -kv[1]))))


if __name__ == "__main__":
    main()
