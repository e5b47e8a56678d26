# Shared by experiments/*/run.sh: one Hydra run per record, one at a time, resumable (a run whose
# results.json is ok is skipped). Source it after setting R (the runs folder).
K="${PYTHON:-.venv/bin/python} -m kvcompress"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # recorded in every record with torch's thread count
run() {
  local name=$1; shift
  if [ -f "$R/$name/results.json" ] && grep -q '"status": "ok"' "$R/$name/results.json"; then return 0; fi
  echo "=== $name $(date +%T)"
  $K "$@" task.progress=false hydra.run.dir="$R/$name" > /dev/null
}
