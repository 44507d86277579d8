"""Where the course finds MNIST: one copy in the course folder serves every chapter."""


from spike_course import data


def test_mnist_in_the_course_folder_serves_a_chapter_folder(tmp_path, monkeypatch):
    raw = tmp_path / "course" / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"")
    chapter = tmp_path / "course" / "notebooks"
    chapter.mkdir()
    monkeypatch.chdir(chapter)
    monkeypatch.delenv("SPIKE_COURSE_DATA", raising=False)
    assert data.mnist_root() == str(tmp_path / "course" / "data")
    assert data.data_source() == f"MNIST files under {tmp_path / 'course' / 'data'}/"


def test_without_mnist_the_source_says_where_it_goes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPIKE_COURSE_DATA", raising=False)
    assert data.mnist_root() == "data"
    assert "data/MNIST/raw/ in the course folder" in data.data_source()
    monkeypatch.setenv("SPIKE_COURSE_DATA", "synthetic")
    assert data.data_source() == "synthetic digits (SPIKE_COURSE_DATA=synthetic)"


def test_the_fallback_is_said_once_per_kernel_and_not_again_by_its_ranks(tmp_path, monkeypatch, capsys):
    """Chapter 00 loads the digits twice in the kernel, then launches a worker that loads them
    too: the learner reads the notice once."""
    from spike_course.lab import launcher, warm
    from spike_course import protocol

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPIKE_COURSE_DATA", raising=False)
    monkeypatch.delenv(protocol.DATA_FALLBACK_SAID_ENV, raising=False)
    def not_on_disk(*args, **kwargs):
        raise RuntimeError("Dataset not found")  # what torchvision's MNIST raises

    monkeypatch.setattr(data, "_torchvision_mnist", not_on_disk)
    monkeypatch.setattr(data, "_mirror_reachable", lambda seconds: False)
    before = warm.server_key("python", launcher._child_env(None, 2, None, ""))
    for _ in range(2):
        assert len(data.load_mnist(limit=4)) == 4
    assert capsys.readouterr().out.count("using synthetic digits") == 1
    ranks_env = launcher._child_env(None, 2, None, "")
    assert ranks_env[protocol.DATA_FALLBACK_SAID_ENV] == "1"  # a launched rank stays quiet
    assert warm.server_key("python", ranks_env) == before  # and the warm helper is the same one
