#!/usr/bin/env bash
# The frontier searches (experiments/frontier/README.md): one per question mode, then the docs' tables.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
K="${PYTHON:-.venv/bin/python} -m kvcompress -m"
$K sweep=frontier_duo
$K sweep=frontier_kvzip
${PYTHON:-.venv/bin/python} scripts/collect.py --docs
