"""Validate the autotuner's tpu-model against JAX's published TPU v5e Pallas matmul measurements.

Rebuilds the JAX Pallas TPU guide's bf16 matmul, models each published (size, block config) row for v5e
(compile-only with libtpu: a model, not a measurement) and prints model vs published time, the Spearman
rank correlation and the relative errors, for the tpu-model and its variants. Data and citation:
``benchmarks/data/jax_pallas_tpu_matmul_v5e.json``. Needs libtpu; ~30 s on 2 cores.

    .venv/bin/python benchmarks/validate_model.py [--json]
"""

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def main():
    from tpukernels.autotune.validation import VARIANTS, load, validate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    data = load()
    v = validate(data)
    if args.json:
        print(json.dumps(v.to_dict(), indent=1))
        return
    print(f"{data['title']} (times in µs; model = tpu-model, a model)\nsource: {data['source']}\n")
    print(v.table())
    print("\nvariants:")
    for k, text in VARIANTS.items():
        print(f"  {k:<18} {text}")
    print(f"\nranks the rows in the published order: {v.published_order}")


if __name__ == "__main__":
    main()
