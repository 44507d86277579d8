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
