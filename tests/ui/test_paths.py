"""The folders squareq ui may touch (squareq/ui/paths.py): a request's path is refused when it is absolute, climbs out
with '..' or leads out through a symbolic link, and a path inside, a link inside included, is taken."""
import pytest

from squareq.ui.paths import OutsideError, Roots, UiError, check_bind, inside, is_local


@pytest.fixture
def root(tmp_path):
    (tmp_path / "runs" / "a" / "samples").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "samples" / "s.png").write_bytes(b"png")
    (tmp_path / "runs" / "out").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "runs" / "in").symlink_to(tmp_path / "runs" / "a", target_is_directory=True)
    return tmp_path / "runs"


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "a/..", "..\\x", "C:/x", "out/x", "a\0b"])
def test_a_path_leading_out_is_refused_in_one_sentence(root, path):
    with pytest.raises(OutsideError, match=r"leads outside .*runs") as caught:
        inside(root, path, "file")
    assert caught.value.status == 403 and str(caught.value).count(". ") == 0


@pytest.mark.parametrize("path", ["a/samples/s.png", "in/samples/s.png", "a/./samples/s.png", "."])
def test_a_path_inside_is_taken_links_inside_included(root, path):
    found = inside(root, path)
    assert found.is_relative_to(root.resolve())


def test_run_names_and_dataset_folders(root, tmp_path):
    roots = Roots(root, (tmp_path,))
    assert roots.run("a") == root / "a"
    for name in (".squareq-ui", "a/b", "", ".."):
        with pytest.raises(OutsideError):
            roots.run(name)
    assert roots.data_folder(0, "runs/a") == root / "a"
    with pytest.raises(UiError, match="dataset root 1 does not exist"):
        roots.data_folder(1, ".")
    with pytest.raises(UiError, match="does not exist under"):
        roots.data_folder(0, "nothing")


def test_a_bind_beyond_this_machine_needs_a_token():
    assert is_local("127.0.0.1") and is_local("localhost") and is_local("::1") and is_local("127.0.0.2")
    assert not is_local("0.0.0.0") and not is_local("192.168.1.5") and not is_local("example.org")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "a secret")
    with pytest.raises(UiError, match=r"^--bind 0.0.0.0 lets other machines reach the page, so it needs --token"):
        check_bind("0.0.0.0", None)
