#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter, or fail with a clear message.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for c in "${PYTHON:-}" python3.13 python3.12 python3; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then echo "$p"; exit 0; fi
done
root=${PYENV_ROOT:-$HOME/.pyenv}
command -v pyenv >/dev/null 2>&1 && root=$(pyenv root)
if [ -d "$root/versions" ]; then
  # 3.12 first: the GPU machine runs 3.12.
  for p in $(ls -d "$root"/versions/3.12*/bin/python3 "$root"/versions/3.1[3-9]*/bin/python3 2>/dev/null); do
    if ok "$p"; then echo "$p"; exit 0; fi
  done
fi
echo "error: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
exit 1
