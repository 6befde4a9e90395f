"""A release from a signal handler while the main thread is inside a call
of the same ``etcd://`` client (issue 26, defect 6, as on a kunci server):
it must not wait for the client's own locks. Real interpreter processes."""

import pytest

import kunci
from test_exit import oldest_and_newest
from test_process import RELEASE_ON_SIGTERM, SIGTERM_RELEASE, release_from_a_signal_handler

ON_ETCD = dict(SIGTERM_RELEASE)
# The signal comes while the main thread holds the lock of the client's
# connection pool (here made to last: taking an idle connection sleeps).
ON_ETCD["holding the pool's lock"] = RELEASE_ON_SIGTERM + """\
        class SlowPop(list):
            def pop(self, *args):
                time.sleep(0.2)
                return list.pop(self, *args)
        members = client._etcd.members
        client.query(KEY + "/busy")
        members._idle = [SlowPop(idle) for idle in members._idle]
        print("ready", flush=True)
        while True:
            client.query(KEY + "/busy")
"""


@pytest.mark.parametrize("doing", sorted(ON_ETCD))
def test_etcd_release_from_a_signal_handler_while_inside_a_call(etcd_cluster, doing):
    observer = kunci.Client(etcd_cluster.address)
    for python in oldest_and_newest():
        key = "sigterm-%s/%s" % (doing.split()[0], python.replace("/", "_"))
        release_from_a_signal_handler(observer, python, doing, ON_ETCD[doing],
                                      etcd_cluster.address, key,
                                      queue_left_within=5, watchdog=10)
    observer.close()
