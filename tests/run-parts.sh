#!/usr/bin/env bash
# `make test`'s runner: the suite in several pytest processes, some side by side, then some alone.
#
#   tests/run-parts.sh PYTHON --jobs N PART... [--then PART...]
#
# A PART is one pytest invocation's arguments (word-split, e.g. "tests/test_cluster.py" or "--ignore=a --ignore=b").
# N workers take the parts before --then in their order (the longest first balances them best), each the next one
# left when it is free: most tests run their models on one thread, so two such processes share two cores well. The
# --then parts run one after another once all of those have finished, alone (their models use every core). Each
# part's output is printed whole when it ends, with its exit status and time. Every part runs; any that fails,
# nothing collected included (pytest's exit code 5), fails the run. Ctrl-C stops every part.
set -uo pipefail

if [ $# -lt 3 ] || [ "$2" != --jobs ]; then
	echo "usage: $0 PYTHON --jobs N PART... [--then PART...]" >&2
	exit 2
fi
python=$1 jobs=$3
shift 3
together=() then=() after=
for arg in "$@"; do
	if [ "$arg" = --then ]; then
		after=1
	elif [ -n "$after" ]; then
		then+=("$arg")
	else
		together+=("$arg")
	fi
done
logs=$(mktemp -d)
stop() {  # Ctrl-C or TERM: every pytest process (their pids are kept in $logs), then the workers
	kill $(cat "$logs"/*.pid 2>/dev/null) $(jobs -p) 2>/dev/null
	rm -rf "$logs"
	exit 130
}
trap stop INT TERM

run_part() {  # run_part NAME ARGS: one pytest process; its log printed whole when it ends; its exit status kept
	local name=$1 args=$2 started=$SECONDS rc
	# shellcheck disable=SC2086  # the part's arguments are word-split on purpose
	"$python" -m pytest -q -p no:cacheprovider $args >"$logs/$name.log" 2>&1 &
	echo $! >"$logs/$name.pid"
	wait $!
	rc=$?
	{
		flock 9
		echo "== pytest $args (exit $rc, $((SECONDS - started)) s)"
		cat "$logs/$name.log"
	} 9>"$logs/.print"
	echo "$rc $args" >"$logs/$name.rc"
}

worker() {  # take the next part not yet taken (a counter under a lock) until none is left
	local next
	while :; do
		{
			flock 8
			next=$(cat "$logs/.next")
			echo $((next + 1)) >"$logs/.next"
		} 8>"$logs/.take"
		[ "$next" -lt ${#together[@]} ] || return 0
		run_part "part$next" "${together[next]}"
	done
}

echo 0 >"$logs/.next"
for _ in $(seq "$jobs"); do
	worker &
done
wait
for i in "${!then[@]}"; do
	run_part "then$i" "${then[i]}"
done

expected=$((${#together[@]} + ${#then[@]}))
finished=$(find "$logs" -name '*.rc' | wc -l)
failed=$(cat "$logs"/*.rc 2>/dev/null | awk '$1 != 0 { $1 = ""; print "[" substr($0, 2) "]" }')
rm -rf "$logs"
if [ "$finished" -ne "$expected" ]; then
	echo "make test: only $finished of $expected parts finished" >&2
	exit 1
fi
if [ -n "$failed" ]; then
	echo "make test: failed:" $failed >&2
	exit 1
fi
