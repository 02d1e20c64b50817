#!/usr/bin/env bash
# The LMCache MP client and server (pinned 0.5.6) without the CUDA and cloud packages its full
# dependency set pulls (cupy, cuda-python, transformers, grpc; numpy downgraded to 2.2): what
# kv_transfer_config={"kv_connector": "lmcache_mp"} and its tests need on a CPU host.
# `pip install 'v41plan[lmcache]'` installs LMCache with all of its declared dependencies instead.
set -euo pipefail
python -m pip install -q --no-deps lmcache==0.5.6 msgspec pyzmq blake3 numba llvmlite psutil \
    py-cpuinfo aiohttp multidict yarl propcache frozenlist aiosignal aiohappyeyeballs attrs \
    requests sortedcontainers prometheus_client cachetools pyyaml opentelemetry-api \
    opentelemetry-sdk opentelemetry-semantic-conventions httpx aiofile aiofiles caio
