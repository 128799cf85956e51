"""Launch SGLang's OpenAI-compatible server with an EAGLE-3 draft (logic: sglang_eagle3/serving/launcher.py).

    python serve/launch_server.py --target meta-llama/Llama-3.1-8B-Instruct --draft ./my-draft \
        --profile tuned.json --batch-size 8 --port 30000 [--dry-run]
"""
import sys

from sglang_eagle3.serving.launcher import main

if __name__ == "__main__":
    sys.exit(main())
