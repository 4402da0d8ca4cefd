#!/usr/bin/env bash
# `make test`'s runner: the suite in several pytest processes, in lanes that run side by side, then parts alone.
#
#   tests/run-parts.sh PYTHON --lane PART... [--lane PART...] [--then PART...]
#
# A PART is one pytest invocation's arguments (word-split, e.g. "tests/test_cluster.py" or "--ignore=a --ignore=b").
# The parts of a lane run one after another; the lanes run at once, each mostly on one core (most tests run their
# models on one thread), and the --then parts run after every lane has finished, alone (their models use every core).
# Each part's output is printed whole when it ends, with its exit status and time. Every part runs; any that fails,
# nothing collected included (pytest's exit code 5), fails the run. Ctrl-C stops every part.
set -uo pipefail

python=$1
shift
logs=$(mktemp -d)
trap 'kill -- $(jobs -p) 2>/dev/null; rm -rf "$logs"; exit 130' INT TERM

run_part() {  # run_part NAME ARGS: one pytest process; its log printed whole when it ends; "NAME rc" recorded
	local name=$1 args=$2 started=$SECONDS rc
	# shellcheck disable=SC2086  # the part's arguments are word-split on purpose
	"$python" -m pytest -q -p no:cacheprovider $args >"$logs/$name.log" 2>&1
	rc=$?
	{
		flock 9
		echo "== pytest $args (exit $rc, $((SECONDS - started)) s)"
		cat "$logs/$name.log"
	} 9>"$logs/.print"
	echo "$rc $args" >"$logs/$name.rc"
}

run_lane() {  # run_lane LANE PART...: the parts one after another
	local lane=$1 i=0
	shift
	for part in "$@"; do
		run_part "$lane-$i" "$part"
		i=$((i + 1))
	done
}

lanes=() then=() current=-1
for arg in "$@"; do
	case $arg in
	--lane) current=$((current + 1)); lanes[current]="" ;;
	--then) current=then ;;
	*)
		if [ "$current" = then ]; then
			then+=("$arg")
		elif [ "$current" -ge 0 ]; then
			lanes[current]+="$arg"$'\n'
		else
			echo "run-parts.sh: a part before the first --lane or --then: $arg" >&2
			exit 2
		fi
		;;
	esac
done

for lane in "${!lanes[@]}"; do
	mapfile -t parts < <(printf '%s' "${lanes[lane]}")
	run_lane "lane$lane" "${parts[@]}" &
done
wait
if [ ${#then[@]} -gt 0 ]; then
	run_lane then "${then[@]}"
fi

expected=${#then[@]}
for lane in "${!lanes[@]}"; do
	expected=$((expected + $(printf '%s' "${lanes[lane]}" | grep -c '')))
done
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
