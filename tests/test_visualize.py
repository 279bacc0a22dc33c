from shardspec import Mesh, P, visualize


def test_grid_for_two_split_dims():
    mesh = Mesh({"dp": 2, "tp": 4}, simulate=True)
    text = visualize((8, 6), mesh, P("dp", "tp"))
    lines = text.splitlines()
    assert lines[0] == "shape (8, 6), dp=2 x tp=4, spec P('dp', 'tp')"
    rows = [line for line in lines if line.strip().startswith(("0:4", "4:8"))]
    assert len(rows) == 2
    assert [c.strip() for c in rows[0].split("|")[1:-1]] == ["dev 0", "dev 1", "dev 2", "dev 3"]
    assert [c.strip() for c in rows[1].split("|")[1:-1]] == ["dev 4", "dev 5", "dev 6", "dev 7"]
    # 6 over 4 is uneven: blocks of 2,2,2,0, sizes shown.
    assert "6:6 (0)" in text and "uneven" in text


def test_replicated_blocks_list_all_holders():
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    text = visualize((4, 4), mesh, P("tp"))
    assert "dev 0,2" in text and "dev 1,3" in text
    assert "replicated over dp" in text


def test_fully_replicated_and_listing_beyond_two_dims():
    mesh = Mesh({"a": 2, "b": 2, "c": 2}, simulate=True)
    assert "dev 0,1,2,3,4,5,6,7" in visualize((3,), mesh, P())
    text = visualize((2, 2, 2), mesh, P("a", "b", "c"))
    assert "[1:2, 0:1, 1:2] -> devices 5" in text
    assert text.count("-> devices") == 8


def test_empty_blocks_each_name_their_own_device():
    text = visualize((10,), Mesh({"dp": 8}, simulate=True), P("dp"))
    for r in range(8):
        assert f"dev {r} " in text
    assert "dev 5,6,7" not in text
