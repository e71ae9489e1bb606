"""attnx build --model of a model that is one attention layer (attnx's own export: its output y is the graph's): the
block is rewritten in place with y keeping its name and dims, and the build stops with one clear error at what a
package for attnx generate needs and a layer lacks (token ids), never an internal error (the splice refused to
replace a graph output: "Set replace_graph_outputs=True")."""

from __future__ import annotations

import onnx

from attnx.cli import main
from attnx.workflows.audit.whole import open_whole_model
from attnx.workflows.rewrite import optimize_model


def test_a_layer_model_is_rewritten_keeping_its_output_then_refused_for_generate(exported, tmp_path, capsys):
    path = exported("causal")
    out = tmp_path / "rewritten.onnx"
    report = optimize_model(open_whole_model(path), str(out))
    assert report.blocks and out.exists()
    graph = onnx.load(str(out), load_external_data=False).graph
    assert [o.name for o in graph.output] == ["y"]  # the layer's own interface, as it was
    assert main(["build", "--model", path, "--out", str(tmp_path / "pkg")]) == 2
    err = capsys.readouterr().err
    assert "takes no input_ids" in err and "internal error" not in err
    assert not (tmp_path / "pkg").exists()
