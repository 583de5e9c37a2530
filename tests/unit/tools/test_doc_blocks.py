"""tools/doc_blocks.py: how a page's fenced blocks are read, and that a broken block fails the page."""

import pytest

from tools.doc_blocks import Block, parse, problems, run_page

pytestmark = pytest.mark.unit

PAGE = """# A page

```bash
echo one
```

<!-- docs-test: skip (gpu) -->
```bash
nvidia-smi
```

!!! note
    ```python title="my_reward.py"
    def f(prompts, completions):
        return [1.0] * len(completions)
    ```

```yaml
learner: {lr: 1.0e-4}
```

```text
output
```
"""


def test_blocks_are_read_with_their_action_file_and_skip_reason():
    blocks = parse(PAGE)
    assert [(b.lang, b.action) for b in blocks] == [
        ("bash", "run"),
        ("bash", "skip"),
        ("python", "write"),
        ("yaml", "config"),
        ("text", "show"),
    ]
    assert blocks[1].skip == "gpu"
    assert blocks[2].file == "my_reward.py"
    assert (
        blocks[2].code == "def f(prompts, completions):\n    return [1.0] * len(completions)\n"
    )  # de-indented


def test_an_unknown_language_is_a_problem_unless_saved_as_a_file():
    assert problems([Block(3, "ruby", "puts 1\n")]) == [
        'line 3: ```ruby is not one of bash, python, text, console, yaml (or give it a title="FILE")'
    ]
    assert problems([Block(3, "ruby", "puts 1\n", file="x.rb")]) == []


@pytest.mark.parametrize(
    "broken",
    [
        "```bash\nfalse\n```\n",
        "```python\nraise SystemExit(3)\n```\n",
        "```yaml\nlearner: {lrr: 1.0e-4}\n```\n",  # a key the config tree does not have
    ],
)
def test_a_failing_block_fails_the_page(tmp_path, broken):
    page = tmp_path / "page.md"
    page.write_text("```bash\necho before\n```\n\n" + broken)
    failed = run_page(page, tmp_path / "work")
    assert len(failed) == 1 and "exited" in failed[0]


def test_files_are_saved_before_the_blocks_that_use_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('```python title="m.py"\nX = 7\n```\n\n```python\nimport m\nassert m.X == 7\n```\n')
    assert run_page(page, tmp_path / "work") == []
