# Source this file: creates ./.venv on first use (or reuses it) and installs the project
# with what training needs (torch pinned to the CPU wheel through constraints.txt).
# Extras on demand: MEGATRON_EXTRAS=test (what the tests import), hf (checkpoint
# conversion), logging (TensorBoard, W&B), ft (torchft: --ft-* fault tolerance), bench,
# dev (all), comma-separated:
#   MEGATRON_EXTRAS=hf,logging source scripts/setup_env.sh
# Set MEGATRON_VENV to use another location, and MEGATRON_TORCH to install another torch
# there instead of the pinned CPU wheel (constraints.txt is then not applied), e.g.
#   MEGATRON_VENV=.venv-torch214 MEGATRON_TORCH=torch==2.14.1 source scripts/setup_env.sh
_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${MEGATRON_VENV:-$_repo_root/.venv}"
_extras="${MEGATRON_EXTRAS:-}"
if [ -n "${MEGATRON_TORCH:-}" ]; then
    _torch="$MEGATRON_TORCH"
    _constraints=()
else
    _torch="torch==2.13.0"
    _constraints=(-c "$_repo_root/constraints.txt")
fi
if [ ! -x "$_venv/bin/python" ]; then
    echo "[setup] creating virtual environment at $_venv"
    python3 -m venv "$_venv"
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"
# One stamp per set of extras: a later call that asks for more installs the rest.
_stamp="$_venv/.megatron-installed${_extras:+-${_extras//,/-}}"
if [ ! -f "$_stamp" ] || [ "$_repo_root/setup.py" -nt "$_stamp" ] || [ "$_repo_root/constraints.txt" -nt "$_stamp" ]; then
    echo "[setup] installing megatron-mfsdp${_extras:+ with extras [$_extras]} ($_torch)"
    # Chained: the stamp only after both installs succeeded, even where the caller's
    # errexit does not apply (a function called in an `||` list).
    python -m pip install --quiet --disable-pip-version-check "${_constraints[@]}" "$_torch" numpy &&
        # setup.py reads MEGATRON_TORCH for its own torch requirement.
        MEGATRON_TORCH="$_torch" python -m pip install --quiet --disable-pip-version-check \
            "${_constraints[@]}" -e "$_repo_root${_extras:+[$_extras]}" &&
        touch "$_stamp" || { echo "[setup] installing into $_venv failed" >&2; return 1; }
fi
export PYTHONPATH="$_repo_root${PYTHONPATH:+:$PYTHONPATH}"
unset _repo_root _venv _stamp _extras _torch _constraints
