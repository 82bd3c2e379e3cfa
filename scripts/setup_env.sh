# Source this file: creates ./.venv on first use (or reuses it) and installs the project
# with its test extras. torch is pinned to the CPU wheel through constraints.txt.
# Set MEGATRON_VENV to use another location.
_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${MEGATRON_VENV:-$_repo_root/.venv}"
if [ ! -x "$_venv/bin/python" ]; then
    echo "[setup] creating virtual environment at $_venv"
    python3 -m venv "$_venv"
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"
_stamp="$_venv/.megatron-installed"
if [ ! -f "$_stamp" ] || [ "$_repo_root/setup.py" -nt "$_stamp" ] || [ "$_repo_root/constraints.txt" -nt "$_stamp" ]; then
    echo "[setup] installing megatron-mfsdp and its test dependencies (torch pinned, CPU build)"
    python -m pip install --quiet --disable-pip-version-check -c "$_repo_root/constraints.txt" torch==2.13.0 numpy
    python -m pip install --quiet --disable-pip-version-check -c "$_repo_root/constraints.txt" -e "$_repo_root[dev]"
    touch "$_stamp"
fi
export PYTHONPATH="$_repo_root${PYTHONPATH:+:$PYTHONPATH}"
unset _repo_root _venv _stamp
