// The lock order of kvtierd: every mutex of the daemon, numbered. A thread that holds a mutex
// takes only mutexes with a higher number, never one with a lower or the same number, except
// where a line says otherwise. Each mutex's declaration names its number; within a class that
// holds two, ABSL_ACQUIRED_BEFORE / ABSL_ACQUIRED_AFTER state it to clang as well.
//
//   1  SessionManager's id gates    not a mutex: a restore from the remote tier (and a close or
//                                   a demotion of a session not held here) holds its id's gate,
//                                   one call at a time for each id, across Redis I/O and an
//                                   Import or a demotion (2, 3, 4); taken with no lock and no
//                                   other gate held (DemoteIdle, inside a restore, takes none)
//   2  SessionManager::mu_          changes of the session map; held only for map work and a
//                                   session's own small getters (3); never across Redis I/O.
//                                   Then one of the map's 16 shard locks (SessionShards), a leaf,
//                                   which a lookup takes alone
//   3  Session::mu_                 one session. A Fork holds the parent's, then the child's
//                                   (not yet visible to any other thread). A demotion writes
//                                   the record to Redis under it (4), so that no append slips
//                                   between the record and the free
//   4  RemoteStore::mu_             the Redis connection (leaf)
//   5  (unused: the prefetcher's tasks wait in a TaskPool's queues, 16)
//   6  LeaseTable's shards          a worker shard's mu (one of 16, by worker id), then a lease
//                                   shard's (by lease id); each alone otherwise. Its tenants'
//                                   map (tenants_mu_) is a leaf taken under neither. Slots are
//                                   unpinned, and dropped (8), after letting go
//   7  PromotionCache's locks       one tier's fp16 copies (host, device): its 16 stripes' in
//                                   order (making room, counting); a read, an insert or a drop
//                                   takes one stripe's alone. Evicting a
//                                   copy frees its slot (8)
//   8  Tier's locks                 one tier's: a shard's mu (one of 16, by the allocating
//                                   account), taken by every slot freed anywhere above; under
//                                   it, or alone, its retained_mu_ or its registry_mu_ (leaves)
//   9  Tier::tenants_mu_            one tier's table of tenants (leaf): an account made
//  10  metrics::Registry::mu_       the metric families (leaf; scrape hooks run outside it).
//                                   A Histogram's flush_mu_, a leaf too, is taken after it is
//                                   let go (a scrape's flush, a read of the counts)
//  11  Daemon::mu_                  shutdown bookkeeping (leaf)
//  12  KvTierService::attach_mu_    the open Attach streams; a drain claims each under it (13)
//                                   and finishes them after letting go
//  13  AttachReactor::mu_           one Attach stream's finish claim and worker id (leaf); let
//                                   go before the worker detaches (6)
//  14  UnixListener peer shards     the Unix socket's connections and their peers, one of 16
//                                   shards by descriptor (leaf)
//  15  FdChannel::mu_               the outstanding descriptor tickets (leaf)
//  16  TaskPool queues' mu          one of a pool's 16 queues (the aging pool's, the
//                                   prefetcher's; leaf); a session submits aging, one task per
//                                   layer, under its own lock (3). A task dropped from a full
//                                   queue is destroyed after the lock
//  17  StagingRegistry::mu_         the staging areas by id (leaf)
//  18  Session::staging_mu_         one session's staging area (leaf); taken under its mu_ (3)
//                                   where the area is set or dropped, and alone by an append
//  19  ChannelHub::mu_              the Select channels (leaf); a channel's worker is attached
//                                   and detached (6) outside it
//  20  SocketExporter::mu_          a socket carrier's queue of bytes to send (leaf)
//  21  KvTierService::Carried::mu_  a carried transfer's last reaction, for its pump (leaf)
//  22  KvTierService::pumps_mu_     the threads of carried transfers (leaf)
//  23  KvTierService::watched_mu_   the transfers in progress, for their idle timeout (leaf).
//                                   gRPC's TryCancel is called under it, and a reactor's
//                                   OnDone takes it: this holds because gRPC (1.51) runs no
//                                   reaction, OnCancel or OnDone of a reactor that is not
//                                   inlineable (none of kvtierd's is) inside TryCancel, but on
//                                   its executor's threads
//
// Outside the daemon, the C++ client library has one mutex of its own (SegmentMap's mappings),
// never held across a call to the daemon.
#ifndef KVTIER_SERVER_COMMON_LOCK_ORDER_H_
#define KVTIER_SERVER_COMMON_LOCK_ORDER_H_
#endif  // KVTIER_SERVER_COMMON_LOCK_ORDER_H_
