package scripts

import (
	"context"
	"strings"

	"github.com/redis/rueidis"
)

// QuietReleaser is a LoneRunner that can release a lock's last hold with two
// plain commands instead of the release script, for a lock on which nobody
// waited lately.
type QuietReleaser interface {
	LoneRunner
	// RunLoneQuietRelease is RunLone(ctx, id, keys, args) for the release of an
	// owner's last count, id being LockRelease or FairRelease: keys and args are
	// the script's, with no count to keep and, for LockRelease, no registration
	// to drop (ARGV[6] not "1"). Its reply is the script's: nil when the owner's
	// field was not there, 1 when the lock was released and somebody heard the
	// unlock message (plain) or was queued (fair), 2 when it was released and
	// nobody listened (plain) or was queued (fair). For the plain lock it never
	// grants the lock to a registered waiter of another client (see below).
	RunLoneQuietRelease(ctx context.Context, id ID, keys, args []string) (Reply, error)
}

var _ QuietReleaser = (*Redis)(nil)

// RunLoneQuietRelease implements QuietReleaser. Removing the only field of a
// hash deletes the key, so for an owner whose count is 1, HDEL of its field is
// exactly what either release script does to the lock (HGET, DEL), and every
// reader of the lock, Redisson included, sees the same. Measured on Redis 7.0
// here, a release script's Lua call with its ten keys and arguments costs an
// uncontended Lock+Unlock cycle about a fifth of its rate on two cores; two
// plain commands cost about what a naive SET NX + compare-and-delete lock pays.
//
// For the plain lock (LockRelease) it sends, in one write,
//
//	HDEL <lock> <owner field>
//	PUBLISH <unlock channel> <unlock message>
//
// the message being Redisson's. What the pair does not do is what the script
// does for waiters: grant the lock directly to another client's registered
// waiter (lock_lib.lua), and skip the message when nobody listens. The message
// always goes: a registered waiter hears it, gives way a moment (the engine's
// public yield) and then takes the lock with a call of its own, as an
// unregistered one does at once; nobody is left waiting. The engine therefore
// sends this only where the lock's last release found nobody listening at all,
// and a reply of 1 (someone heard this one) sends it back to the script.
// PUBLISH counts pattern subscribers too, where the script's PUBSUB NUMSUB does
// not: a listener on a pattern makes the reply 1 where the script's would be 2,
// which only sends the next release to the script. When HDEL finds no field
// (the hold was lost) the message still goes: an unlock message is a hint to
// retry, and a waiter that retries finds the lock as it is. So does a retry's
// after a transport error, whether the first try ran or not.
//
// For the fair lock (FairRelease) it sends
//
//	HDEL <lock> <owner field>
//	LINDEX <queue> 0
//
// and when the queue is empty that is all fair_release does (its purge of stale
// heads has nothing to purge). When somebody is queued, the script runs next,
// on the same connection: it finds the owner's field gone and, the lock being
// free, passes it on to the queue's head (a grant or a wake-up), purging stale
// heads first, so the queue moves as it would have, a round trip later. Until
// then only that head can take the lock (fair_acquire lets nobody else past a
// queue), and if it does, or the purge leaves nobody and an arrival takes it,
// the script leaves the lock alone.
//
// An error reply to HDEL is returned as the script's would be; a transport
// error likewise (whether the commands ran is unknown). An error reply to
// LINDEX (a queue key that is not a list) is returned too, the lock released
// already, where fair_release would have failed before its DEL. PUBLISH refused after
// HDEL ran (an ACL user without channel permissions, which the script, not
// publishing where nobody listens, never needed uncontended) counts as a release
// nobody heard, and sends every later release of this Redis to the script.
// Nobody is left waiting unless the connection fails between the two commands
// and the release's retry fails too: then a waiter wakes at its own retry.
func (r *Redis) RunLoneQuietRelease(ctx context.Context, id ID, keys, args []string) (Reply, error) {
	r.spin.Begin()
	defer r.spin.End()
	d := r.loneConn()
	if d == nil || !quietShape(id, keys, args) || (id == LockRelease && r.noPublish.Load()) {
		return r.RunLone(ctx, id, keys, args)
	}
	hdel, second := quietCommands(d.B(), id, keys, args)
	res := d.DoMulti(ctx, hdel, second)
	if id == LockRelease {
		out := r.quietLockResult(res[0], res[1])
		if out.Err != nil {
			return Reply{}, r.quietErr(d, out.Err)
		}
		return out.Reply, nil
	}
	r.countRan(res...)
	deleted, err := res[0].AsInt64()
	if err != nil {
		return Reply{}, r.quietErr(d, err)
	}
	head, err := res[1].ToMessage()
	switch {
	case err != nil && !rueidis.IsRedisNil(err):
		return Reply{}, r.quietErr(d, err)
	case !head.IsNil():
		// Somebody is queued: pass the lock on to the queue (see above).
		reply, err := r.RunLone(ctx, FairRelease, keys, args)
		if err != nil || deleted == 0 {
			return reply, err
		}
		return Reply{Int: 1, SentAt: reply.SentAt}, nil
	case deleted == 0:
		return Reply{Nil: true}, nil
	default:
		return Reply{Int: 2}, nil
	}
}

// quietCommands are a quiet release's two commands: HDEL of the owner's field,
// then, for LockRelease, PUBLISH of the unlock message, for FairRelease LINDEX of
// the queue's head.
func quietCommands(b rueidis.Builder, id ID, keys, args []string) (hdel, second rueidis.Completed) {
	hdel = b.Hdel().Key(keys[0]).Field(args[2]).Build()
	if id == FairRelease {
		return hdel, b.Lindex().Key(keys[1]).Index(0).Build()
	}
	return hdel, b.Publish().Channel(keys[1]).Message(args[0]).Build()
}

// quietShape reports whether keys and args are a last-count release that
// RunLoneQuietRelease can send as plain commands.
func quietShape(id ID, keys, args []string) bool {
	switch id {
	case LockRelease:
		// ARGV[6] "1" drops a registration; ARGV[7] other than "0" keeps a count.
		return len(keys) >= 2 && len(args) >= 3 && len(args) <= 7 &&
			(len(args) < 6 || args[5] != "1") && (len(args) < 7 || args[6] == "0")
	case FairRelease:
		return len(keys) == 5 && len(args) == 5 // ARGV[6] would keep a count
	}
	return false
}

// quietErr returns err, first dropping the lone connection after a transport
// error.
func (r *Redis) quietErr(d rueidis.DedicatedClient, err error) error {
	if _, isReply := rueidis.IsRedisErr(err); !isReply {
		r.dropLone(d)
	}
	return err
}

// countRan counts, among the replies of plain commands the scripts also run
// (see SharedCommandsSent), those of commands Redis ran: a reply (nil
// included), or an error reply other than an ACL refusal (which INFO commandstats counts apart, as
// rejected); not a transport error.
func (r *Redis) countRan(res ...rueidis.RedisResult) {
	for _, x := range res {
		err := x.Error()
		e, isReply := rueidis.IsRedisErr(err)
		if err == nil || rueidis.IsRedisNil(err) || isReply && !strings.HasPrefix(e.Error(), "NOPERM") {
			r.shared.Add(1)
		}
	}
}

// SharedCommandsSent returns how many commands RunLoneQuietRelease,
// RunLoneFreshFair and RunBatch's quiet releases have had run that the scripts
// also run inside Lua (HDEL, PUBLISH, LINDEX; RESTORE is never run by a script). Redis counts the commands
// inside scripts in INFO commandstats as it counts the client's own, so a tool
// that counts a client's requests from there (the benchmark harness) adds
// these to what it takes for script-only commands.
func (r *Redis) SharedCommandsSent() uint64 { return r.shared.Load() }
