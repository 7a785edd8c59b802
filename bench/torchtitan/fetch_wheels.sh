#!/usr/bin/env bash
# Download the wheels run.sh installs, for a GPU machine without internet: run this on a machine with
# internet, then carry bench/torchtitan/whl/ over. Targets Python 3.12 on manylinux x86_64 (all nine
# are pure Python; multiprocess's wheel is the one made for 3.12). The set that ran on the H200:
# torchtitan's dependencies not found in a CUDA PyTorch image, pinned so they fit one: datasets 4.0.0
# is the newest that asks only pyarrow >= 15 and pins dill < 0.3.9 and multiprocess < 0.70.17;
# typeguard 4.6.0 (for tyro 1.0.17) needs typing-extensions >= 4.14.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
    --dest "$HERE/whl" \
    torchtitan==0.2.2 torchdata==0.11.0 datasets==4.0.0 dill==0.3.8 multiprocess==0.70.16 \
    tyro==1.0.17 typeguard==4.6.0 docstring-parser==0.18.0 typing-extensions==4.16.0
