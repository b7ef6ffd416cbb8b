#!/usr/bin/env bash
# The Python environment of the acceptance suites (tests/http, tests/soak, tests/netns): a venv at
# target/http-venv with pinned packages, made or remade when the pins change. Prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the official client, pytest, a JSON-schema validator (structured output), and what
# they resolve to.
requirements='
openai==3.57.0
pytest==9.2.0
jsonschema==4.26.0
attrs==26.1.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
annotated-types==0.8.0
anyio==4.16.0
h11==0.16.0
httpcore2==2.16.2
httpx2==2.16.2
idna==3.20
iniconfig==2.3.1
jiter==0.19.0
packaging==26.4
pluggy==1.7.0
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
sniffio==1.3.1
truststore==0.10.5
typing-inspection==0.4.5
typing_extensions==4.16.0
'
venv=target/http-venv
stamp=$venv/.requirements
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$(printf %s "$requirements")" ]; then
    echo "http-venv: setting up $venv" >&2
    # Debian's python3 makes venvs only with its python3-venv package.
    python3 -m venv --clear "$venv" >/dev/null 2>&1 || { scripts/apt-install.sh python3-venv && python3 -m venv --clear "$venv"; }
    printf '%s' "$requirements" > "$venv/requirements.txt"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$venv/requirements.txt" >&2
    printf '%s' "$requirements" > "$stamp"
fi
echo "$venv"
