#!/usr/bin/env bash
# The wheels bench/gpu_check.py installs on a GPU machine without network: the packages its image lacks
# (trl, bitsandbytes, datasets and what datasets needs beyond the image) and the pinned versions of
# transformers, peft and accelerate, for the machine's Python 3.12 on x86-64. Run where pip reaches PyPI:
#     bash bench/gpu_wheels.sh .whl        # about 57 MiB; then: python bench/gpu_check.py --wheels .whl ...
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash bench/gpu_wheels.sh DIR}"
pin() { grep -h -E "^$1==" requirements.txt constraints.txt | head -1; }
names=(trl bitsandbytes datasets dill multiprocess transformers peft accelerate)
pins=()
for name in "${names[@]}"; do
  p="$(pin "$name")"
  [ -n "$p" ] || { echo "error: no pin for $name in requirements.txt or constraints.txt" >&2; exit 2; }
  pins+=("$p")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$out" "${pins[@]}"
ls -l "$out"
