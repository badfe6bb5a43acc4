package scripts

import (
	"context"
	"strconv"

	"github.com/redis/rueidis"
)

// FreshFairRunner is a LoneRunner that can take a fair lock it expects to find
// free, with nobody queued, with plain commands instead of the acquire script.
type FreshFairRunner interface {
	LoneRunner
	// RunLoneFreshFair is RunLone(ctx, FairAcquire, keys, args) for a waiter's
	// first attempt on a fair lock the caller expects nobody to hold or queue
	// for: keys and args are fair_acquire's (ARGV[5] "0" or "1": take, or
	// queue or fail), channel the lock's unlock channel (fair_release's KEYS[4]).
	// Its reply and error are the script's.
	RunLoneFreshFair(ctx context.Context, keys, args []string, channel string) (Reply, error)
}

var _ FreshFairRunner = (*Redis)(nil)

// fairUnlockMessage is the message fair_release wakes an unregistered head
// with: Redisson's unlock message.
const fairUnlockMessage = "0"

// RunLoneFreshFair implements FreshFairRunner. It sends, in one write,
//
//	RESTORE <lock> <lease ms> <payload>
//	LINDEX <queue> 0
//
// the payload being RunLoneFresh's DUMP of {<owner field>: "1"}. When RESTORE
// creates the lock and LINDEX finds the queue empty, the caller holds the lock
// exactly as fair_acquire would have given it (a free lock, nobody queued):
// from LINDEX on, anyone who comes queues behind the holder. Measured here, the
// two plain commands make an uncontended fair Lock+Unlock cycle about a quarter
// faster than the acquire script's Lua call with its eleven keys and arguments.
//
// Otherwise the script decides, on the same connection, dated at its own send:
//   - RESTORE refused (the lock exists: BUSYKEY; or any other refusal, handled
//     as RunLoneFresh does): fair_acquire runs.
//   - RESTORE created the lock but somebody is queued: the caller took the lock
//     past the queue, for a moment in which it was never told it holds it. The
//     lock is given back before fair_acquire runs: by fair_release, which
//     passes it on to the queue's head (a direct grant, or a wake-up on its
//     channel) as any release would, so a head that tried in that moment and
//     was refused is not left waiting; or, when the head is the caller's own
//     field (a queue entry of its handle's), by HDEL, and fair_acquire then
//     takes the lock as that head.
//   - LINDEX failed with an error reply (the queue key is not a list): the lock
//     is given back by HDEL and the error returned, as the script's purge
//     would have failed.
//
// A transport error is returned as the script call's would be: whether the
// commands ran is unknown. The lock may then be held under the caller's field,
// past the queue, and the caller's next attempt (the script, which claims a
// hold it finds under the caller's field) would keep it there: so the caller
// gives that field back first (the engine's attemptFailed). fair_acquire, the
// last step, may also have queued the caller: a caller that gives up then
// leaves the queue, as after any attempt whose reply was lost.
func (r *Redis) RunLoneFreshFair(ctx context.Context, keys, args []string, channel string) (Reply, error) {
	r.spin.Begin()
	defer r.spin.End()
	d := r.loneConn()
	if d == nil || r.noRestore.Load() || len(keys) != 4 || len(args) < 5 || (args[4] != "0" && args[4] != "1") {
		return r.RunLone(ctx, FairAcquire, keys, args)
	}
	lease, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || lease <= 0 {
		return r.RunLone(ctx, FairAcquire, keys, args) // the script's own error or answer
	}
	lock, queue, field := keys[0], keys[1], args[1]
	res := d.DoMulti(ctx,
		d.B().Restore().Key(lock).Ttl(lease).SerializedValue(r.dumpOf(field)).Build(),
		d.B().Lindex().Key(queue).Index(0).Build())
	r.countRan(res[1])
	if err := res[0].Error(); err != nil {
		return r.afterRestore(ctx, d, err, FairAcquire, keys, args)
	}
	head, err := res[1].ToString()
	switch {
	case rueidis.IsRedisNil(err):
		return Reply{Nil: true}, nil // held, nobody queued
	case err != nil:
		if _, isReply := rueidis.IsRedisErr(err); !isReply {
			r.dropLone(d)
			return Reply{}, err
		}
		return Reply{}, r.giveBackFresh(ctx, d, lock, field, err)
	case head == field:
		if err := r.giveBackFresh(ctx, d, lock, field, nil); err != nil {
			return Reply{}, err
		}
	default:
		releaseKeys := []string{lock, queue, keys[2], channel, keys[3]}
		releaseArgs := []string{fairUnlockMessage, args[0], field, args[3], args[2]}
		if _, err := r.RunLone(ctx, FairRelease, releaseKeys, releaseArgs); err != nil {
			if _, isReply := rueidis.IsRedisErr(err); isReply {
				err = r.giveBackFresh(ctx, d, lock, field, err)
			}
			return Reply{}, err
		}
	}
	return r.runLoneAfter(ctx, FairAcquire, keys, args)
}

// giveBackFresh deletes the field a RESTORE just created and returns cause, or
// the deletion's own error (after which the connection is dropped if it broke).
func (r *Redis) giveBackFresh(ctx context.Context, d rueidis.DedicatedClient, lock, field string, cause error) error {
	res := d.Do(ctx, d.B().Hdel().Key(lock).Field(field).Build())
	r.countRan(res)
	if err := res.Error(); err != nil {
		return r.quietErr(d, err)
	}
	return cause
}
