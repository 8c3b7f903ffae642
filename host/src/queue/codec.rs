//! How laneway's values are stored, once for every backend: each type here
//! encodes and decodes itself for SQLite and for PostgreSQL, so the store
//! binds and reads them the same way on both, and a value no laneway wrote
//! is the same error on both ([`QueueError::Corrupt`], by [`get`]).
//!
//! | value | SQLite | PostgreSQL |
//! |---|---|---|
//! | [`Ts`] a time | INTEGER, Unix milliseconds | `timestamptz` |
//! | [`Lanes`] an op's lanes | TEXT, a JSON array | `text[]` |
//! | [`Token`] a lease token | TEXT | `uuid` |
//! | [`Rank`] a priority | INTEGER 0–2 | `smallint` 0–2 |
//! | [`St`] a status | TEXT | `text` |
//! | [`List`], [`Times`] a parameter list | TEXT, a JSON array | an array |

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo, PgValueFormat, PgValueRef, Postgres};
use sqlx::sqlite::{Sqlite, SqliteArgumentValue, SqliteTypeInfo, SqliteValueRef};
use sqlx::{Decode, Encode, Type};
use uuid::Uuid;

use super::QueueError;
use crate::op::{OpId, Priority, Status};

/// A point in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ts(pub DateTime<Utc>);

/// An op's lanes, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lanes(pub Vec<String>);

/// A lease token (ops, drain slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token(pub Uuid);

/// A priority tier, stored as its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rank(pub Priority);

/// An op's status, stored by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct St(pub Status);

/// A list bound as one parameter (`IN (SELECT value FROM json_each($n))`
/// on SQLite, `= ANY($n)` on PostgreSQL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct List<T>(pub Vec<T>);

/// A list of times bound as one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Times(pub Vec<DateTime<Utc>>);

/// Reads `column` of a row, naming `id` (the op, or 0) and the column when
/// the stored value cannot be read as `T`.
///
/// # Errors
///
/// [`QueueError::Corrupt`] for a value that does not decode; a database
/// error for anything else.
pub fn get<'r, T, R>(row: &'r R, id: OpId, column: &'static str) -> Result<T, QueueError>
where
    R: sqlx::Row,
    T: Decode<'r, R::Database> + Type<R::Database>,
    &'static str: sqlx::ColumnIndex<R>,
{
    row.try_get(column).map_err(|e| match e {
        sqlx::Error::ColumnDecode { source, .. } => QueueError::Corrupt {
            id,
            column,
            value: source.to_string(),
        },
        other => QueueError::from(other),
    })
}

fn rank(r: i64) -> Result<Rank, BoxDynError> {
    Priority::from_rank(r)
        .map(Rank)
        .ok_or_else(|| format!("priority rank {r} is not 0, 1 or 2").into())
}

fn status(s: &str) -> Result<St, BoxDynError> {
    s.parse()
        .map(St)
        .map_err(|_| format!("status {s:?} is not one laneway writes").into())
}

/// Delegates `Type` for a wrapper to the type it is stored as.
macro_rules! stored_as {
    ($db:ty, $wrapper:ty, $inner:ty) => {
        impl Type<$db> for $wrapper {
            fn type_info() -> <$db as sqlx::Database>::TypeInfo {
                <$inner as Type<$db>>::type_info()
            }
            fn compatible(ty: &<$db as sqlx::Database>::TypeInfo) -> bool {
                <$inner as Type<$db>>::compatible(ty)
            }
        }
    };
}

// --- SQLite ---------------------------------------------------------------

stored_as!(Sqlite, Ts, i64);
stored_as!(Sqlite, Lanes, String);
stored_as!(Sqlite, Token, String);
stored_as!(Sqlite, Rank, i64);
stored_as!(Sqlite, St, String);
stored_as!(Sqlite, Times, String);

impl<T> Type<Sqlite> for List<T> {
    fn type_info() -> SqliteTypeInfo {
        <String as Type<Sqlite>>::type_info()
    }
}

type SqliteBuf<'q> = Vec<SqliteArgumentValue<'q>>;

fn sqlite_json<'q>(value: &impl Serialize, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
    Encode::<Sqlite>::encode(serde_json::to_string(value)?, buf)
}

impl<'q> Encode<'q, Sqlite> for Ts {
    fn encode_by_ref(&self, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
        Encode::<Sqlite>::encode(self.0.timestamp_millis(), buf)
    }
}

impl<'r> Decode<'r, Sqlite> for Ts {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        let ms = <i64 as Decode<Sqlite>>::decode(value)?;
        DateTime::from_timestamp_millis(ms)
            .map(Ts)
            .ok_or_else(|| format!("{ms} ms is not a time laneway can read").into())
    }
}

impl<'q> Encode<'q, Sqlite> for Lanes {
    fn encode_by_ref(&self, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
        sqlite_json(&self.0, buf)
    }
}

impl<'r> Decode<'r, Sqlite> for Lanes {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        let text = <&str as Decode<Sqlite>>::decode(value)?;
        serde_json::from_str(text)
            .map(Lanes)
            .map_err(|_| format!("{text:?} is not a JSON array of lane names").into())
    }
}

impl<'q> Encode<'q, Sqlite> for Token {
    fn encode_by_ref(&self, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
        Encode::<Sqlite>::encode(self.0.to_string(), buf)
    }
}

impl<'r> Decode<'r, Sqlite> for Token {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        let text = <&str as Decode<Sqlite>>::decode(value)?;
        text.parse()
            .map(Token)
            .map_err(|_| format!("{text:?} is not a lease token").into())
    }
}

impl<'q> Encode<'q, Sqlite> for Rank {
    fn encode_by_ref(&self, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
        Encode::<Sqlite>::encode(i64::from(self.0.rank()), buf)
    }
}

impl<'r> Decode<'r, Sqlite> for Rank {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        rank(<i64 as Decode<Sqlite>>::decode(value)?)
    }
}

impl<'q> Encode<'q, Sqlite> for St {
    fn encode_by_ref(&self, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
        Encode::<Sqlite>::encode(self.0.as_str(), buf)
    }
}

impl<'r> Decode<'r, Sqlite> for St {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        status(<&str as Decode<Sqlite>>::decode(value)?)
    }
}

impl<'q, T: Serialize> Encode<'q, Sqlite> for List<T> {
    fn encode_by_ref(&self, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
        sqlite_json(&self.0, buf)
    }
}

impl<'q> Encode<'q, Sqlite> for Times {
    fn encode_by_ref(&self, buf: &mut SqliteBuf<'q>) -> Result<IsNull, BoxDynError> {
        let ms: Vec<i64> = self.0.iter().map(DateTime::timestamp_millis).collect();
        sqlite_json(&ms, buf)
    }
}

// --- PostgreSQL -----------------------------------------------------------

stored_as!(Postgres, Ts, DateTime<Utc>);
stored_as!(Postgres, Lanes, Vec<String>);
stored_as!(Postgres, Token, Uuid);
stored_as!(Postgres, Rank, i16);
stored_as!(Postgres, St, String);
stored_as!(Postgres, Times, Vec<DateTime<Utc>>);

impl<T: PgHasArrayType> Type<Postgres> for List<T> {
    fn type_info() -> PgTypeInfo {
        T::array_type_info()
    }
    fn compatible(ty: &PgTypeInfo) -> bool {
        T::array_compatible(ty)
    }
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_US: i64 = 946_684_800_000_000;

impl Encode<'_, Postgres> for Ts {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        Encode::<Postgres>::encode_by_ref(&self.0, buf)
    }
}

impl<'r> Decode<'r, Postgres> for Ts {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        if value.format() == PgValueFormat::Binary {
            // Read by hand: chrono's own decoding overflows (and panics) on
            // 'infinity', which PostgreSQL stores as i64::MAX.
            let us = <i64 as Decode<Postgres>>::decode(value)?;
            return us
                .checked_add(PG_EPOCH_US)
                .and_then(DateTime::from_timestamp_micros)
                .map(Ts)
                .ok_or_else(|| format!("{us} µs from 2000-01-01 is not a time laneway can read").into());
        }
        Ok(Ts(<DateTime<Utc> as Decode<Postgres>>::decode(value)?))
    }
}

impl Encode<'_, Postgres> for Lanes {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        Encode::<Postgres>::encode_by_ref(&self.0, buf)
    }
}

impl<'r> Decode<'r, Postgres> for Lanes {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(Lanes(<Vec<String> as Decode<Postgres>>::decode(value)?))
    }
}

impl Encode<'_, Postgres> for Token {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        Encode::<Postgres>::encode_by_ref(&self.0, buf)
    }
}

impl<'r> Decode<'r, Postgres> for Token {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(Token(<Uuid as Decode<Postgres>>::decode(value)?))
    }
}

impl Encode<'_, Postgres> for Rank {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        Encode::<Postgres>::encode(self.0.rank(), buf)
    }
}

impl<'r> Decode<'r, Postgres> for Rank {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        rank(i64::from(<i16 as Decode<Postgres>>::decode(value)?))
    }
}

impl Encode<'_, Postgres> for St {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        Encode::<Postgres>::encode(self.0.as_str(), buf)
    }
}

impl<'r> Decode<'r, Postgres> for St {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        status(<&str as Decode<Postgres>>::decode(value)?)
    }
}

impl<'q, T> Encode<'q, Postgres> for List<T>
where
    Vec<T>: Encode<'q, Postgres>,
{
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        self.0.encode_by_ref(buf)
    }
}

impl Encode<'_, Postgres> for Times {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        Encode::<Postgres>::encode_by_ref(&self.0, buf)
    }
}
