#!/usr/bin/env bash
# The test suite as two pytest processes side by side: tests/dagster (one bootstrapped Dagster home for all
# of them, ordered by their conftest) and everything else. Each writes its own log, printed when both end;
# the exit status is the first non-zero one. Usage: scripts/test.sh PYTHON [extra pytest args...]
set -uo pipefail
python=$1
shift
logs=$(mktemp -d)
common=(-q -ra --durations=15 -m "not learning and not vllm_graph" "$@")
# Two suites share the cores: a trainer's second OpenMP thread would spin against the other suite
# (LD_TRAINER_THREADS, see training.trainer.TrainerConfig.threads); engines already default to one thread.
export LD_TRAINER_THREADS="${LD_TRAINER_THREADS:-1}"
# each suite is bounded (CI allows 90 min in all): a hung one is stopped, its log still printed below
bound=(timeout -k 60 "${LD_SUITE_TIMEOUT_S:-3600}")
"${bound[@]}" "$python" -m pytest "${common[@]}" tests/dagster >"$logs/dagster.log" 2>&1 &
dagster=$!
"${bound[@]}" "$python" -m pytest "${common[@]}" --ignore=tests/dagster tests >"$logs/rest.log" 2>&1 &
rest=$!
# a line a minute, so a CI log shows the run is alive
while [ -n "$(jobs -rp)" ]; do
  sleep "${LD_TEST_TICK:-60}"
  echo "[tests] $(date -u +%H:%M:%S) dagster: $(tail -c 80 "$logs/dagster.log" | tr -d '\n' | tail -c 40) | rest: $(tail -c 80 "$logs/rest.log" | tr -d '\n' | tail -c 40)"
done
wait "$dagster"
dagster_status=$?
wait "$rest"
rest_status=$?
echo "===== tests outside tests/dagster (exit $rest_status) ====="
cat "$logs/rest.log"
echo "===== tests/dagster (exit $dagster_status) ====="
cat "$logs/dagster.log"
# last, so the end of a CI log names what failed
echo "===== summary ====="
for suite in rest dagster; do
  echo "--- $suite: $(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|[0-9]+ (passed|failed|errors?) in ' "$logs/$suite.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$logs/$suite.log" | cut -c1-400
  grep -E '^\[exit watchdog\]' "$logs/$suite.log" | head -20
done
[ "$rest_status" -eq 124 ] && echo "rest: stopped after ${LD_SUITE_TIMEOUT_S:-3600} s"
[ "$dagster_status" -eq 124 ] && echo "dagster: stopped after ${LD_SUITE_TIMEOUT_S:-3600} s"
if [ "$rest_status" -ne 0 ]; then exit "$rest_status"; fi
exit "$dagster_status"
