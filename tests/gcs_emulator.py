"""A local GCS server (gcp-storage-emulator) for tests: started on a free loopback port, stopped after.

tensorstore's gs:// driver follows TENSORSTORE_GCS_HTTP_URL; orbax reaches gs:// directories
through etils.epath -> fsspec -> gcsfs, which follows STORAGE_EMULATOR_HOST. Both are set while
the server runs, so the code under test uses its real gs:// paths unchanged.

Two gaps of the emulator are patched in the server process, where real GCS behaves otherwise:
- It ignores the startOffset/endOffset parameters of object listing, and tensorstore lists (and
  deletes ranges, e.g. for `delete_existing=True`) with them, so every range operation would see,
  and delete, the whole bucket.
- Its media downloads (GET ...?alt=media) carry no `x-goog-generation` header, and it ignores the
  ifGenerationMatch / ifGenerationNotMatch conditions of reads and uploads. tensorstore takes an
  object's generation from that header, so it recorded generation 0 for every object it read;
  OCDBT re-reads its manifest with ifGenerationNotMatch=<the generation it holds>, and tensorstore
  refuses generation 0 before sending anything: "Error reading gs://.../ocdbt.process_0/
  manifest.ocdbt: Malformed StorageGeneration". Whether a save or restore re-read the manifest was
  a race (6 of 10 Checkpointer round trips failed so). The patch sends the header and answers the
  conditions as GCS does (304 Not Modified, 412 Precondition Failed), so OCDBT checkpoints work.
"""
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(bucket: str = "scone-test"):
    """Yields the gs:// URL of an empty bucket on a fresh in-memory server."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, str(port), bucket],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    env = {"TENSORSTORE_GCS_HTTP_URL": url, "STORAGE_EMULATOR_HOST": url,
           "NO_GCE_CHECK": "True"}  # google-auth (under gcsfs) would probe a GCE metadata server for seconds
    saved = {k: os.environ.get(k) for k in env}
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start on port {port}")
                time.sleep(0.1)
        os.environ.update(env)
        yield f"gs://{bucket}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        server.wait(timeout=30)


def _serve(port: int, bucket: str) -> None:
    """Run the emulator with object listing restricted to [startOffset, endOffset), and with
    generations sent and generation conditions answered on object reads and uploads."""
    from http import HTTPStatus

    from gcp_storage_emulator import server, storage
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    request_range = threading.local()
    original_ls, original_list = objects.ls, storage.Storage.get_file_list

    def ls(request, response, *args, **kwargs):
        query = request.query
        request_range.bounds = (query["startOffset"][0] if query.get("startOffset") else "",
                                query["endOffset"][0] if query.get("endOffset") else None)
        try:
            return original_ls(request, response, *args, **kwargs)
        finally:
            request_range.bounds = ("", None)

    def get_file_list(self, *args, **kwargs):
        files, prefixes = original_list(self, *args, **kwargs)
        low, high = getattr(request_range, "bounds", ("", None))
        return [f for f in files if f["name"] >= low and (high is None or f["name"] < high)], prefixes

    storage.Storage.get_file_list = get_file_list

    original_download, original_get, original_insert = objects.download, objects.get, objects.insert

    def live_object(store, request, object_id) -> dict | None:
        try:
            return store.get_file_obj(request.params["bucket_name"], object_id)
        except NotFound:
            return None

    def precondition_failed(request, response, obj) -> bool:
        """Answer GCS's conditional-request parameters; True when the request ends here."""
        generation = obj["generation"] if obj else "0"  # GCS's generation of "no live object"
        match, not_match = request.query.get("ifGenerationMatch"), request.query.get("ifGenerationNotMatch")
        if match and match[0] != generation:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return True
        if not_match and not_match[0] == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return True
        return False

    def download(request, response, store, *args, **kwargs):
        obj = live_object(store, request, request.params["object_id"])
        if obj is not None:  # a missing object stays the emulator's 404
            if precondition_failed(request, response, obj):
                return None
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]
        return original_download(request, response, store, *args, **kwargs)

    def get(request, response, store, *args, **kwargs):
        if request.query.get("alt", [""])[0] != "media":  # alt=media: original_get calls download
            obj = live_object(store, request, request.params["object_id"])
            if obj is not None and precondition_failed(request, response, obj):
                return None
        return original_get(request, response, store, *args, **kwargs)

    def insert(request, response, store, *args, **kwargs):
        name = request.query.get("name")
        if name and precondition_failed(request, response, live_object(store, request, name[0])):
            return None
        return original_insert(request, response, store, *args, **kwargs)

    objects.download = download  # objects.get calls it for alt=media
    replace = {original_ls: ls, original_download: download, original_get: get, original_insert: insert}
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler in replace:
                handlers[method] = replace[handler]
    server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
