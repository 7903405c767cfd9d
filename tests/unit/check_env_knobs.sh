#!/usr/bin/env bash
# Note [Environment knobs] (include/ddp/env.h): kEnvKnobs is the one list of variables that tune
# ddp-cpp. Fails when
#   - a row of kEnvKnobs is missing from the knob table of docs/errors-and-environment.md (its
#     '## Environment knobs' section: name and default), or that table lists a knob the header
#     does not;
#   - code outside src/base reads the environment with getenv() instead of ddp::env_knob()
#     (a line that only saves a value to restore it says "not a knob").
# Usage: check_env_knobs.sh <source dir>
set -euo pipefail
root=$1
status=0

# Header rows: {"NAME", "default", "meaning"},
header=$(sed -n '/kEnvKnobs\[\] = {/,/^};/p' "$root/include/ddp/env.h" |
         sed -nE 's/^ *\{"([A-Z_0-9]+)", "([^"]*)",.*/\1\t\2/p')
[[ -n $header ]] || { echo "check_env_knobs: no rows found in kEnvKnobs"; exit 1; }
# The doc's rows of the knob table, from its heading to the next one: | `NAME` | default | meaning |
doc=docs/errors-and-environment.md
table=$(sed -n '/^##* Environment knobs/,/^#/p' "$root/$doc" |
        sed -nE 's/^\| `([A-Z_0-9]+)` \| ([^|]*[^ |]) *\|.*/\1\t\2/p')
[[ -n $table ]] || { echo "check_env_knobs: $doc has no 'Environment knobs' table"; exit 1; }

while IFS=$'\t' read -r name default; do
  row=$(grep -P "^$name\t" <<<"$table" || true)
  if [[ -z $row ]]; then
    echo "$doc: knob $name (include/ddp/env.h) is not in the Environment knobs table"
    status=1
  elif [[ ${row#*$'\t'} != "$default" ]]; then
    echo "$doc: knob $name: default '${row#*$'\t'}', the header says '$default'"
    status=1
  fi
done <<<"$header"
while IFS=$'\t' read -r name _; do
  grep -qP "^$name\t" <<<"$header" ||
    { echo "$doc: knob $name is not a row of kEnvKnobs (include/ddp/env.h)"; status=1; }
done <<<"$table"

# Direct reads outside src/base.
direct=$(cd "$root" && grep -rn --include='*.cpp' --include='*.h' 'getenv(' src tools include |
         grep -v '^src/base/' | grep -v 'not a knob' || true)
if [[ -n $direct ]]; then
  echo "read the environment through ddp::env_knob() (a row of kEnvKnobs), not getenv():"
  echo "$direct"
  status=1
fi
exit $status
